"""What the channel's Python costs per message, warm, in one process (no contention).

One message of ``--rows`` rows goes to this same rank over ``MPI_COMM_SELF`` and is received,
three ways, interleaved in rounds (medians reported):

* ``channel``: the public API, as the runtime and bench_m2n use it:
  ``post(reserve())``, ``recv().wait().release()``, ``handle.wait()``;
* ``inline``: the same slots, headers, persistent requests and checks (magic, iteration)
  written out in one function, no API calls, handles or error paths: what the channel's
  work would cost with its calls and objects folded away (a bound, not a product path);
* ``bare``: one persistent send and one persistent receive, ``Start`` and ``Test``:
  the MPI calls alone.

Usage: ``.venv/bin/python perf/bench_m2n_python_cost.py`` (about 20 s; no mpiexec needed:
a singleton MPI process). Writes ``perf/results/bench_m2n_python_cost.json`` (``--out``).
The contended cost is a multiple of these (3-4 ranks on 2 cores: 3-5x, caches evicted by the
rank sharing the core); see docs/comm.md.
"""
import argparse
import datetime
import os
import platform
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from megainfer.comm import Channel, MessageSpec
from megainfer.comm import slot as SL
from megainfer.comm.mpi import MpiTransport

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_io import write_json  # noqa: E402

ROW = 1024  # bytes per row, as in bench_m2n


def channel_op(ch: Channel, rows: int):
    def run(i):
        h = ch.post(ch.reserve(0, rows), iteration=i, layer=0, micro_batch=0)
        ch.recv(0, layer=0, micro_batch=0, iteration=i).wait().release()
        h.wait()
    return run


def inline_op(ch: Channel, rows: int):
    """The channel's own slots and requests, its work written out (single stream, depth 2)."""
    pack, unpack, yield_ = SL._pack, SL._unpack, os.sched_yield
    ring = ch._recv[0][0]
    nbytes, tag = ch._nbytes[rows], ch._tags[0]

    def run(i):
        ring_out, k = ch._send[0], ch._send_ptr[0]
        out = ring_out[k]
        ch._send_ptr[0] = k ^ 1
        if not out.clear:
            while not out.req.test():
                yield_()
        pack(out.hdr, 0, ch._magic, 0, rows, i, 0, 0, ch.rank, 0)
        out.req = out.io.start(nbytes, tag)
        out.clear = False
        slot = ring.slots[ring.post_ptr]
        if slot.state == SL.FREE:  # re-post the slot released last time
            slot.req = slot.io.start(ring.nbytes, ring.tag)
            slot.state = SL.POSTED
            ring.post_ptr ^= 1
        slot = ring.slots[ring.next_ptr]
        ring.next_ptr ^= 1
        test = slot.req.test
        while not test():
            yield_()
        h = unpack(slot.hdr)
        if h[0] != ch._magic or h[3] != i:
            raise RuntimeError(f"bad header {h}")
        slot.state = SL.FREE
        while not out.req.test():
            yield_()
        out.clear = True
    return run


def bare_op(comm: MPI.Comm, nbytes: int):
    send = comm.Send_init([np.ones(nbytes, np.uint8), nbytes, MPI.BYTE], 0, 5)
    recv = comm.Recv_init([np.empty(nbytes, np.uint8), nbytes, MPI.BYTE], 0, 5)
    yield_ = os.sched_yield

    def run(i):
        recv.Start()
        send.Start()
        while not recv.Test():
            yield_()
        while not send.Test():
            yield_()
    return run, (send, recv)


def measure(ops: dict, rounds: int, per_round: int) -> dict:
    times = {k: [] for k in ops}
    i = 0
    for _ in range(rounds):
        for name, op in ops.items():
            for _ in range(200):  # warm
                op(i)
                i += 1
            t0 = time.perf_counter()
            for _ in range(per_round):
                op(i)
                i += 1
            times[name].append((time.perf_counter() - t0) / per_round)
    return {k: float(np.median(v)) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2, help="rows per message (1 KiB each)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--per-round", type=int, default=5000)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_m2n_python_cost.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    t = MpiTransport(MPI.COMM_SELF)
    spec = MessageSpec.of(max(args.rows, 1), x=((ROW // 4,), torch.float32))
    chans = [Channel(t, [0], [0], spec, streams=1, depth=2) for _ in range(2)]
    bare, reqs = bare_op(MPI.COMM_SELF, spec.nbytes(args.rows))
    got = measure({"channel": channel_op(chans[0], args.rows),
                   "inline": inline_op(chans[1], args.rows), "bare": bare},
                  args.rounds, args.per_round)
    print(f"one message sent to self and received ({spec.nbytes(args.rows)} bytes), warm, "
          f"median of {args.rounds} rounds x {args.per_round}")
    print(f"{'method':>8} {'us/msg':>8} {'vs bare':>8} {'Python over bare':>17}")
    for k, v in got.items():
        print(f"{k:>8} {v * 1e6:>8.2f} {v / got['bare']:>8.2f} {(v - got['bare']) * 1e6:>14.2f} us")
    res = dict(us_per_message={k: v * 1e6 for k, v in got.items()},
               channel_over_inline_us=(got["channel"] - got["inline"]) * 1e6,
               rows=args.rows, nbytes=spec.nbytes(args.rows), rounds=args.rounds,
               per_round=args.per_round,
               date=datetime.datetime.now().isoformat(timespec="seconds"),
               machine=dict(platform=platform.platform(), cpu_count=os.cpu_count(),
                            python=platform.python_version(), loadavg=os.getloadavg()),
               command=" ".join(sys.argv))
    for ch in chans:
        ch.close()
    for r in reqs:
        r.Free()
    t.close()
    write_json(args.out, res)


if __name__ == "__main__":
    main()
