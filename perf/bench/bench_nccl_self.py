"""NCCL transport on one GPU: what megainfer.comm's Channel adds on top of raw NCCL.

One GPU cannot hold two NCCL ranks (NCCL refuses a communicator with the same device twice),
so this runs a 1-rank communicator that sends to itself, and times one message per op
(issue, then poll an event on the host until it completed), methods interleaved per
iteration, for message sizes 2 KB - 8 MB:

  channel    Channel over NcclTransport: reserve, then recv + post in one NCCL group, wait,
             release (the zero-copy path the runtime uses; 32-byte header included)
  channel-torch  the same, with the transport's earlier flush: the same CUDA work (stream
             wait, header copies, events) through torch's Python API instead of the driver
  nccl-raw   ctypes ncclGroupStart / ncclSend / ncclRecv / ncclGroupEnd of the same bytes on
             one stream, an event, the same host poll: the floor of any layer over NCCL
  copy       a device-to-device copy of the same bytes, same event and poll: the floor of
             moving bytes on one GPU at all
  torch-a2a  torch.distributed NCCL all_to_all_single, world size 1 (a collective)

Per row: p50 / p99 time per op, algbw (bytes / p50), host issue time (until the call that
posts returns), and the ratios channel / nccl-raw. Multi-GPU numbers (NVLink, two ranks)
need a machine with two GPUs and are not measured here.

  python perf/bench/bench_nccl_self.py [--sizes 2K,8K,...] [--scale 1.0] [--out PATH]
Writes perf/results/bench_nccl_self.json (rewritten after every size).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"
SIZES = "2K,8K,32K,128K,512K,2M,8M"
ROW = 1024  # bytes per row: field x is float32 [256]


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1].upper(), 1)
    return int(s[:-1] if s[-1].isalpha() else s) * mult


def poll(ev: torch.cuda.Event) -> None:
    while not ev.query():
        pass


def channel_method(t, size):
    from megainfer.comm import Channel, MessageSpec, WaitPolicy
    from megainfer.comm.spec import alloc_nbytes
    rows = max(1, size // ROW)
    spec = MessageSpec.of(rows, x=((ROW // 4,), torch.float32))
    ch = Channel(t, [0], [0], spec, streams=1, depth=2, wait=WaitPolicy("spin"))

    def issue():
        out = ch.reserve(0, rows)
        with ch.group():
            rh = ch.recv(0, layer=0, micro_batch=0)
            sh = ch.post(out, iteration=0, layer=0, micro_batch=0)
        return rh, sh

    def finish(handles):
        rh, sh = handles
        msg = rh.wait()
        assert msg.rows == rows
        msg.release()
        sh.wait()
    return issue, finish, alloc_nbytes(spec), ch


def torch_calls_transport():
    """NcclTransport with its earlier flush (kept here as the baseline it replaced): the same
    stream wait, header copies and events through torch's Python API, torch's event query."""
    from megainfer.comm.nccl import NcclTransport, _NcclRequest

    class TorchEventRequest(_NcclRequest):
        __slots__ = ()

        def test(self) -> bool:
            if not self.done and self.issued:
                self.done = self.event.query()
            return self.done

    class TorchCallsNccl(NcclTransport):
        def _request_for(self, buf):
            return TorchEventRequest(self.cu, buf.extra["event"])

        def _flush(self):
            ops, self._ops = self._ops, []
            s = self.stream
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                for is_send, buf, _ in ops:
                    if is_send:
                        buf.data[:32].copy_(buf.extra["pinned"].view(torch.uint8),
                                            non_blocking=True)
                self._nccl_group(ops)
                for is_send, buf, _ in ops:
                    if not is_send:
                        buf.extra["pinned"].view(torch.uint8).copy_(buf.data[:32],
                                                                     non_blocking=True)
                    buf.extra["event"].record(s)
                    buf.extra["req"].issued = True
    from mpi4py import MPI
    return TorchCallsNccl(MPI.COMM_SELF)


def raw_method(t, nbytes):
    from megainfer.comm.nccl import NCCL_UINT8
    lib, comm = t.lib, t._comm
    s = torch.cuda.Stream()
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ev = torch.cuda.Event()
    sp, dp, sh = ctypes.c_void_p(src.data_ptr()), ctypes.c_void_p(dst.data_ptr()), \
        ctypes.c_void_p(s.cuda_stream)

    def issue():
        assert lib.ncclGroupStart() == 0
        assert lib.ncclSend(sp, nbytes, NCCL_UINT8, 0, comm, sh) == 0
        assert lib.ncclRecv(dp, nbytes, NCCL_UINT8, 0, comm, sh) == 0
        assert lib.ncclGroupEnd() == 0
        ev.record(s)
        return ev
    return issue, poll, (src, dst)


def copy_method(nbytes):
    s = torch.cuda.Stream()
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ev = torch.cuda.Event()

    def issue():
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        ev.record(s)
        return ev
    return issue, poll, (src, dst)


def torch_a2a_method(nbytes):
    import torch.distributed as dist
    x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ev = torch.cuda.Event()

    def issue():
        dist.all_to_all_single(y, x)
        ev.record()
        return ev
    return issue, poll, (x, y)


def init_torch_nccl() -> str | None:
    """torch.distributed with the NCCL backend, one rank; None, or why it is unavailable."""
    try:
        import torch.distributed as dist
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, device_id=torch.device("cuda", 0))
        return None
    except Exception as exc:  # noqa: BLE001 - an optional baseline: report why it is missing
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def time_methods(methods: dict, iters: int, warm: int = 5) -> dict:
    """Each method once per iteration, round-robin; op time = issue + host poll to done."""
    out = {k: dict(op=[], issue=[]) for k in methods}
    for i in range(iters + warm):
        for name, (issue, finish) in methods.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = issue()
            t1 = time.perf_counter()
            finish(h)
            t2 = time.perf_counter()
            if i >= warm:
                out[name]["op"].append(t2 - t0)
                out[name]["issue"].append(t1 - t0)
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_size(t, t_old, size, scale, a2a_why):
    issue, finish, nbytes, ch = channel_method(t, size)
    old_i, old_f, _, ch_old = channel_method(t_old, size)
    raw_i, raw_f, keep1 = raw_method(t, nbytes)
    cp_i, cp_f, keep2 = copy_method(nbytes)
    methods = {"channel": (issue, finish), "channel-torch": (old_i, old_f),
               "nccl-raw": (raw_i, raw_f), "copy": (cp_i, cp_f)}
    if a2a_why is None:
        a_i, a_f, keep3 = torch_a2a_method(nbytes)
        methods["torch-a2a"] = (a_i, a_f)
    iters = max(30, int(min(400, (1 << 31) // nbytes) * scale))
    samples = time_methods(methods, iters)
    ch.close()
    ch_old.close()
    rows = []
    for name, s in samples.items():
        p50, p99 = statistics.median(s["op"]), pct(s["op"], 0.99)
        rows.append(dict(method=name, size=size, nbytes=nbytes, iters=iters, p50_us=p50 * 1e6,
                         p99_us=p99 * 1e6, algbw_gbps=nbytes / p50 / 1e9,
                         issue_p50_us=statistics.median(s["issue"]) * 1e6))
    if a2a_why is not None:
        rows.append(dict(method="torch-a2a", size=size, nbytes=nbytes, unavailable=a2a_why))
    raw = next(r for r in rows if r["method"] == "nccl-raw")
    for r in rows:
        if "p50_us" in r:
            r["p50_vs_raw"] = r["p50_us"] / raw["p50_us"]
            r["p99_vs_raw"] = r["p99_us"] / raw["p99_us"]
    return rows


def print_rows(rows):
    print(f"{'size':>6} {'method':<14}{'iters':>6}{'p50 us':>9}{'p99 us':>9}{'algbw GB/s':>11}"
          f"{'issue us':>9}{'p50/raw':>8}{'p99/raw':>8}")
    for r in rows:
        head = f"{r['size'] >> 10:>5}K {r['method']:<14}"
        if "unavailable" in r:
            print(head + f"unavailable: {r['unavailable']}")
            continue
        print(head + f"{r['iters']:>6}{r['p50_us']:>9.1f}{r['p99_us']:>9.1f}"
              f"{r['algbw_gbps']:>11.2f}{r['issue_p50_us']:>9.1f}{r['p50_vs_raw']:>8.2f}"
              f"{r['p99_vs_raw']:>8.2f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=SIZES)
    ap.add_argument("--scale", type=float, default=1.0, help="iteration count multiplier")
    ap.add_argument("--out", default=str(RESULTS / "bench_nccl_self.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_nccl_self: needs a CUDA GPU; nothing was written")
    from mpi4py import MPI

    from megainfer.comm.nccl import NcclTransport, nccl_version
    t = NcclTransport(MPI.COMM_SELF)
    t_old = torch_calls_transport()
    a2a_why = init_torch_nccl()
    res = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
               device=torch.cuda.get_device_name(), torch=torch.__version__,
               nccl=nccl_version(t.lib), cpus=os.cpu_count(), argv=sys.argv[1:], rows=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for size in (parse_size(s) for s in args.sizes.split(",")):
        rows = bench_size(t, t_old, size, args.scale, a2a_why)
        print_rows(rows)
        res["rows"] += rows
        out.write_text(json.dumps(res, indent=1))  # a crash keeps every size done so far
    res["summary"] = {}
    for m in ("channel", "channel-torch", "torch-a2a"):
        rs = [r for r in res["rows"] if r["method"] == m and "p50_us" in r]
        if rs:
            res["summary"][m] = dict(
                p50_vs_raw_median=statistics.median(r["p50_vs_raw"] for r in rs),
                p50_vs_raw_max=max(r["p50_vs_raw"] for r in rs),
                issue_p50_us_median=statistics.median(r["issue_p50_us"] for r in rs))
    out.write_text(json.dumps(res, indent=1))
    print(f"[bench_nccl_self] {res['summary']}")
    print(f"[bench_nccl_self] wrote {out}")
    t.close()
    t_old.close()
    if a2a_why is None:
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
