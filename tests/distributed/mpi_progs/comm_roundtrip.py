"""MPI worker: M attention ranks <-> N expert ranks through M2N, ping-pong schedule, verified.

Usage: mpiexec -n 4 python comm_roundtrip.py CONFIG [CONFIG ...]
CONFIG: MxN:iters:layers:mbs:streams:depth:hidden:capacity (e.g. 2x2:100:2:3:1:2:8:16), or
"timeout". One launch runs every config on a sub-communicator of the first M+N ranks; the
others wait (sleeping, not spinning). Each config prints "RESULT <config> OK ..." on rank 0.

Payloads are a deterministic function of (iteration, layer, micro_batch, src, dst) so the
receiver rebuilds and compares them exactly; a CRC32 of the fields rides in the header's aux.
Experts reply out = 2*hidden + sum(topk_weights), which attention checks the same way.
"""
import os
import sys
import time
import zlib

import torch
from mpi4py import MPI

from abort_on_error import run_or_abort

from megainfer.comm import (KIND_DATA, KIND_STOP, M2N, CommTimeoutError, MessageTooLargeError,
                            WaitPolicy, combine_spec, dispatch_spec, make_transports)
from megainfer.comm.mpi import MAX_PERSISTENT

torch.set_num_threads(1)
WORLD = MPI.COMM_WORLD
TOPK, NEXP = 2, 8
CORRUPT = os.environ.get("COMM_TEST_CORRUPT") == "1"  # proves the checks can fail


def rows_for(key: tuple, cap: int) -> int:
    h = zlib.crc32(repr(key).encode())
    return 0 if h % 4 == 0 else h % (cap + 1)  # a quarter are empty, the rest in [0, cap]


def payload(key: tuple, cap: int, hidden: int):
    n = rows_for(key, cap)
    base = float(zlib.crc32(repr(key).encode()) % 997)
    h = torch.arange(n * hidden, dtype=torch.float32).view(n, hidden) + base        # [n, H]
    ids = ((torch.arange(n * TOPK, dtype=torch.int32) + int(base)) % NEXP).view(n, TOPK)  # [n, k]
    w = (torch.arange(n * TOPK, dtype=torch.float32).view(n, TOPK) + base) / 1024.0  # [n, k]
    return h, ids, w


def crc(*ts) -> int:
    c = 0
    for t in ts:
        c = zlib.crc32(t.contiguous().numpy().tobytes(), c)
    return c - (1 << 32) if c >= (1 << 31) else c  # header aux is int32


def attention(link: M2N, me: int, cfg: dict, stats: dict):
    L, m, it_n, H, cap = cfg["layers"], cfg["mbs"], cfg["iters"], cfg["hidden"], cfg["cap"]
    experts = link.expert_ranks

    def send(it, layer, mb):
        for e in experts:
            h, ids, w = payload((it, layer, mb, me, e), cap, H)
            link.a2e.send(e, iteration=it, layer=layer, micro_batch=mb, aux=crc(h, ids, w),
                          hidden=h, topk_ids=ids, topk_weights=w)
            stats["msgs"] += 1
            stats["empty"] += h.shape[0] == 0
            stats["bytes"] += link.a2e.spec.nbytes(h.shape[0])

    for it in range(it_n):
        for mb in range(m):  # prologue: m micro-batches in flight per expert
            send(it, 0, mb)
        for layer in range(L):
            for mb in range(m):
                handles = [link.recv_combine(e, layer=layer, micro_batch=mb, iteration=it)
                           for e in experts]
                for e, hd in zip(experts, handles):
                    msg = hd.wait()
                    h, _, w = payload((it, layer, mb, me, e), cap, H)
                    want = 2 * h + w.sum(-1, keepdim=True)                         # [n, H]
                    assert msg.rows == h.shape[0], (msg.header, h.shape)
                    assert torch.equal(msg["out"], want), f"combine payload from {e} differs"
                    assert msg.header.aux == crc(msg["out"]), "combine crc"
                    stats["checked"] += 1
                    msg.release()
                if layer + 1 < L:
                    send(it, layer + 1, mb)
    for hd in link.stop(iteration=it_n, layer=0, micro_batch=0):
        hd.wait()


def expert(link: M2N, me: int, cfg: dict, stats: dict):
    L, m, H, cap = cfg["layers"], cfg["mbs"], cfg["hidden"], cfg["cap"]
    it = 0
    while True:
        for layer in range(L):
            for mb in range(m):
                handles = [link.recv_dispatch(a, layer=layer, micro_batch=mb, iteration=it)
                           for a in link.attn_ranks]
                msgs = [hd.wait() for hd in handles]
                if any(msg.kind == KIND_STOP for msg in msgs):
                    assert all(msg.kind == KIND_STOP for msg in msgs), "partial stop"
                    assert it == cfg["iters"] and layer == 0 and mb == 0, (it, layer, mb)
                    return
                for a, msg in zip(link.attn_ranks, msgs):
                    assert msg.kind == KIND_DATA
                    h, ids, w = payload((it, layer, mb, a, me), cap, H)
                    assert msg.rows == h.shape[0], (msg.header, h.shape)
                    assert msg.header.aux == crc(msg["hidden"], msg["topk_ids"],
                                                 msg["topk_weights"]), "dispatch crc"
                    assert torch.equal(msg["hidden"], h) and torch.equal(msg["topk_ids"], ids) \
                        and torch.equal(msg["topk_weights"], w), f"dispatch payload from {a}"
                    out = link.e2a.reserve(a, msg.rows)  # zero-copy reply: compute into the slot
                    o = out.fields["out"]                                           # [n, H]
                    torch.mul(msg["hidden"], 2, out=o)
                    o.add_(msg["topk_weights"].sum(-1, keepdim=True))
                    c = crc(o)
                    if CORRUPT and msg.rows:
                        o[0, 0] += 1
                    link.e2a.post(out, iteration=it, layer=layer, micro_batch=mb, aux=c)
                    msg.release()
                    stats["checked"] += 1
        it += 1


def parse(text: str) -> dict:
    mn, iters, layers, mbs, streams, depth, hidden, cap = text.split(":")
    M, N = map(int, mn.split("x"))
    return dict(M=M, N=N, iters=int(iters), layers=int(layers), mbs=int(mbs),
                streams=int(streams), depth=int(depth), hidden=int(hidden), cap=int(cap))


def run_roundtrip(sub, cfg: dict) -> dict:
    M, N = cfg["M"], cfg["N"]
    me = sub.Get_rank()
    attn, exps = list(range(M)), list(range(M, M + N))
    link = M2N(make_transports("mpi", sub), attn, exps,
               dispatch_spec(cfg["cap"], cfg["hidden"], TOPK, torch.float32),
               combine_spec(cfg["cap"], cfg["hidden"], torch.float32),
               micro_batches=cfg["mbs"], streams=cfg["streams"], depth=cfg["depth"], wait=WaitPolicy(timeout_s=60.0))
    stats = dict(msgs=0, empty=0, bytes=0, checked=0)
    (attention if me < M else expert)(link, me, cfg, stats)
    # send slots that met more (bytes, tag) keys than they keep persistent requests for, and
    # so also sent with plain Isend (the 1x1 config's 0..128 rows do)
    stats["isend_fallback"] = sum(len(s.io.reqs) >= MAX_PERSISTENT for ch in (link.a2e, link.e2a)
                                  for ring in ch._send.values() for s in ring)
    link.close()
    link.a2e.t.close()
    return stats


def run_timeout(sub) -> dict:
    """Rank 1 waits for a dispatch that never comes; rank 0 waits for a combine likewise."""
    me = sub.Get_rank()
    link = M2N(make_transports("mpi", sub), [0], [1], dispatch_spec(4, 8, TOPK, torch.float32),
               combine_spec(4, 8, torch.float32), micro_batches=2,
               wait=WaitPolicy(timeout_s=0.5))
    t0 = time.perf_counter()
    try:
        if me == 0:
            link.recv_combine(1, layer=3, micro_batch=1, iteration=7).wait()
        else:
            link.recv_dispatch(0, layer=3, micro_batch=1, iteration=7).wait()
        raise AssertionError("no timeout raised")
    except CommTimeoutError as e:
        waited = time.perf_counter() - t0
        peer = 1 - me
        assert (e.peer, e.layer, e.micro_batch, e.iteration) == (peer, 3, 1, 7), str(e)
        for s in (f"peer rank {peer}", "layer=3", "micro_batch=1", "iteration=7"):
            assert s in str(e), (s, str(e))
        assert 0.4 < waited < 10.0, waited
    if me == 0:  # too many rows: typed error before anything is sent
        try:
            link.dispatch(1, iteration=0, layer=0, micro_batch=0,
                          hidden=torch.zeros(5, 8), topk_ids=torch.zeros(5, TOPK, dtype=torch.int32),
                          topk_weights=torch.zeros(5, TOPK))
            raise AssertionError("no MessageTooLargeError")
        except MessageTooLargeError as e:
            assert "5 rows exceed" in str(e) and "capacity of 4" in str(e), str(e)
    link.close()
    link.a2e.t.close()
    return dict(waited=round(waited, 3))


def idle_until_all(comm) -> None:
    """Barrier that sleeps instead of spinning (ranks outnumber cores here)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def main():
    rank = WORLD.Get_rank()
    for text in sys.argv[1:]:
        cfg = None if text == "timeout" else parse(text)
        need = 2 if cfg is None else cfg["M"] + cfg["N"]
        assert need <= WORLD.Get_size(), f"{text} needs {need} ranks"
        sub = WORLD.Split(0 if rank < need else MPI.UNDEFINED, rank)
        if sub != MPI.COMM_NULL:
            t0 = time.perf_counter()
            stats = run_timeout(sub) if cfg is None else run_roundtrip(sub, cfg)
            stats["secs"] = round(time.perf_counter() - t0, 2)
            all_stats = sub.gather(stats, root=0)
            if rank == 0:
                tot = {k: sum(s.get(k, 0) for s in all_stats)
                       for k in ("msgs", "empty", "bytes", "checked", "isend_fallback")}
                print(f"RESULT {text} OK {tot} per-rank={all_stats}", flush=True)
            sub.Free()
        idle_until_all(WORLD)


if __name__ == "__main__":
    run_or_abort(main)
