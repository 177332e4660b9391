"""Node-sharing calibration: what ranks on one node cost each other, as ratios and host times.

contention_slowdown  thread CPU time of one per-layer kernel (attention or experts) while a
                     second process runs the same kernel / its CPU time alone; interleaved over
                     rounds (medians), so other tenants' load cancels and what is left is memory
                     bandwidth / cache sharing.
hop_overhead         host seconds per (layer, micro-batch) outside the kernels, with the
                     runtime's own exchange over the in-process loopback transport, at 1 and 2
                     peers -> base, per_peer.

  python -m megainfer.calibration.node_bench load SHAPE_JSON KIND B CTX EXPERTS BENCH  (the co-runner)
docs/perfmodel.md, "Calibration"."""
from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import time

import torch

from megainfer.calibration.layer_bench import bench_fns, time_fn
from megainfer.perfmodel.model.shapes import ModelShape


def _kernel(shape: ModelShape, kind: str, b: int, ctx: int, experts: int, bench: str, copies: int):
    make_a, make_e = bench_fns(bench)
    return make_a(shape, b, ctx, "float32", copies) if kind == "attention" else \
        make_e(shape, b, experts, "float32", copies)


def _cpu_time(fn, min_s: float) -> float:
    """Thread CPU seconds per call, looping until min_s of CPU time."""
    return time_fn(fn, repeats=1, warmup=0, min_time_s=min_s, clock="thread")


def contention_slowdown(shape: ModelShape, kind: str, b: int = 32, ctx: int = 128, experts: int = 2,
                        bench: str = "torch_ops", rounds: int = 5, min_s: float = 0.1,
                        timeout_s: float = 120) -> dict:
    """{'slowdown': median(together / alone), 'alone_s', 'together_s', 'ratios'} for one kernel."""
    torch.set_num_threads(1)
    copies = shape.num_layers
    fn = _kernel(shape, kind, b, ctx, experts, bench, copies)
    for _ in range(copies):
        fn()
    sd = json.dumps({k: getattr(shape, k) for k in shape.__dataclass_fields__})
    cmd = [sys.executable, "-m", "megainfer.calibration.node_bench", "load", sd, kind, str(b), str(ctx),
           str(experts), bench]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    alone, together = [], []
    try:
        _expect(p, "ready", timeout_s)
        for _ in range(rounds):
            alone.append(_cpu_time(fn, min_s))
            p.stdin.write("go\n")
            _expect(p, "running", timeout_s)
            together.append(_cpu_time(fn, min_s))
            p.stdin.write("stop\n")
            _expect(p, "stopped", timeout_s)
        p.stdin.write("quit\n")
        p.wait(timeout=timeout_s)
    finally:
        if p.poll() is None:
            p.kill()
    ratios = [t / a for a, t in zip(alone, together)]
    return {"kind": kind, "b": b, "slowdown": max(1.0, statistics.median(ratios)),
            "alone_s": statistics.median(alone), "together_s": statistics.median(together),
            "ratios": ratios}


def _expect(p, word: str, timeout_s: float) -> None:
    line = _readline(p.stdout, timeout_s)
    if line.strip() != word:
        raise RuntimeError(f"node_bench co-runner: expected {word!r}, got {line!r}")


def _readline(f, timeout_s: float) -> str:
    r, _, _ = select.select([f], [], [], timeout_s)
    if not r:
        raise RuntimeError(f"node_bench co-runner: no answer in {timeout_s} s")
    return f.readline()


def _co_runner(shape_json: str, kind: str, b: str, ctx: str, experts: str, bench: str) -> None:
    """Runs the kernel between 'go' and 'stop' lines on stdin (the second process)."""
    torch.set_num_threads(1)
    shape = ModelShape(**json.loads(shape_json))
    fn = _kernel(shape, kind, int(b), int(ctx), int(experts), bench, shape.num_layers)
    for _ in range(shape.num_layers):
        fn()
    print("ready", flush=True)
    for cmd in sys.stdin:
        cmd = cmd.strip()
        if cmd == "quit":
            return
        if cmd == "go":
            print("running", flush=True)
            while not select.select([sys.stdin], [], [], 0)[0]:
                fn()
            sys.stdin.readline()  # "stop"
            print("stopped", flush=True)


# ---------------------------------------------------------------- host overhead per hop
def _exchanges(n_attn: int, n_exp: int, hidden: int, top_k: int, capacity: int, num_experts: int):
    from megainfer.comm import M2N, combine_spec, dispatch_spec, make_transports
    from megainfer.comm.loopback import LoopbackFabric
    from megainfer.runtime.pipeline.exchange import AttentionExchange, ExpertExchange
    fab = LoopbackFabric(n_attn + n_exp)
    attn, exp = list(range(n_attn)), list(range(n_attn, n_attn + n_exp))
    owner = torch.arange(num_experts) * n_exp // num_experts  # [E] expert-rank index of each slot

    def m2n(r):
        return M2N(make_transports("loopback", fabric=fab, rank=r), attn, exp,
                   dispatch_spec(capacity, hidden, top_k, torch.float32),
                   combine_spec(capacity, hidden, torch.float32), micro_batches=1)
    return [AttentionExchange(m2n(r), owner) for r in attn], [ExpertExchange(m2n(r)) for r in exp]


@torch.inference_mode()
def _hop_times(shape: ModelShape, n_attn: int, n_exp: int, b: int, hops: int) -> tuple[float, float]:
    """Median thread-CPU seconds of one (layer, micro-batch) on an attention and an expert rank."""
    h, k, e = shape.hidden_size, shape.top_k, shape.num_experts
    ax, ex = _exchanges(n_attn, n_exp, h, k, b * n_attn, e)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, h, generator=g)  # [b, H]
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(b)])  # [b, k]
    w = torch.rand(b, k, generator=g)
    resid, shared = torch.randn(b, h), torch.randn(b, h)
    ta, te = [], []
    for it in range(hops):
        l = it % shape.num_layers
        t0 = time.thread_time()
        flights = [a.dispatch(it, l, 0, x, ids, w) for a in ax]
        t1 = time.thread_time()
        for xe in ex:
            batch = xe.receive(it, l, 0)
            counts = [bx.shape[0] for bx, _, _ in batch]
            xs = torch.cat([bx[0] for bx in batch])  # [n, H] (the kernel would run here)
            torch.cat([bx[1] for bx in batch]).long()
            torch.cat([bx[2] for bx in batch])
            xe.reply(it, l, 0, list(torch.split(xs, counts)))
        t2 = time.thread_time()
        for a, f in zip(ax, flights):
            resid + (a.combine(f) + shared)  # [b, H] residual + routed + shared
        t3 = time.thread_time()
        ta.append((t1 - t0 + t3 - t2) / n_attn)
        te.append((t2 - t1) / n_exp)
    warm = hops // 5
    return statistics.median(ta[warm:]), statistics.median(te[warm:])


def hop_overhead(shape: ModelShape, b: int = 32, hops: int = 200) -> dict:
    """{'attention': {'base', 'per_peer'}, 'expert': {...}} from 1 and 2 peers (seconds)."""
    torch.set_num_threads(1)
    a1, e1 = _hop_times(shape, 1, 1, b, hops)
    a2, _ = _hop_times(shape, 1, 2, b, hops)  # attention talking to 2 expert ranks
    _, e2 = _hop_times(shape, 2, 1, b, hops)  # expert rank hearing from 2 replicas
    line = lambda t1, t2: {"base": max(0.0, 2 * t1 - t2), "per_peer": max(0.0, t2 - t1)}  # noqa: E731
    return {"attention": line(a1, a2), "expert": line(e1, e2), "tokens_per_peer": b}


# ---------------------------------------------------------------- wake-up latency of a wait
def wake_latency(wait_s: float = 0.004, trials: int = 40, policy=None) -> dict:
    """Mean delay between a flag being set and a thread waiting on it with the runtime's wait
    policy (``megainfer.comm.wait``, default backoff) noticing. The setter sleeps ``wait_s``
    plus a uniform [0, 2 max_sleep_s) first, so the waiter has reached its longest sleep (as a
    rank waiting for a layer has) and the flag falls at a random phase of its polls."""
    import random
    import threading
    from megainfer.comm.wait import WaitPolicy, wait_until
    policy = policy or WaitPolicy()
    delays, rng = [], random.Random(0)
    for _ in range(trials):
        flag, t_set, t_seen = [False], [0.0], [0.0]

        def waiter():
            wait_until(lambda: flag[0], policy)
            t_seen[0] = time.perf_counter()
        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(wait_s + rng.uniform(0, 2 * policy.max_sleep_s))
        t_set[0] = time.perf_counter()
        flag[0] = True
        th.join()
        delays.append(t_seen[0] - t_set[0])
    return {"mean_s": statistics.fmean(delays), "median_s": statistics.median(delays),
            "wait_s": wait_s, "mode": policy.mode, "max_sleep_s": policy.max_sleep_s}


def measure_node(shape: ModelShape, bench: str = "torch_ops", experts: int = 2, smoke: bool = False) -> dict:
    """The ``node:`` section of a CPU profile (see hardware.NodeProfile), plus raw figures."""
    rounds = 2 if smoke else 5
    cont = {k: contention_slowdown(shape, k, 8 if smoke else 32, 32 if smoke else 128, experts, bench,
                                   rounds, 0.02 if smoke else 0.1) for k in ("attention", "expert")}
    hop = hop_overhead(shape, 8 if smoke else 32, 40 if smoke else 200)
    wake = wake_latency(trials=10 if smoke else 40)
    return {"cores": os.cpu_count() or 1,
            "contention": {k: round(v["slowdown"], 4) for k, v in cont.items()},
            "hop_overhead_s": {k: hop[k] for k in ("attention", "expert")},
            "wake_latency_s": wake["mean_s"],
            "raw": {"contention": cont, "hop_tokens_per_peer": hop["tokens_per_peer"], "wake": wake}}


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "load":
        _co_runner(*sys.argv[2:])
    else:
        sys.exit(__doc__)
