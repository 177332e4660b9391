"""Figures read off a traced PD bench launch (``perf/bench/bench_pd.py --trace``: each run's ``spans``,
[rank, lane, iteration, layer, micro-batch, tokens, start ms, duration ms]) for
perf/validate/validate_sim_pd.py: what each part of the job took, to set beside the simulator's parts.

* ``idle_decode_busy``: while the prefill rank runs its first step the decode pool has nothing
  to decode, yet the runtime keeps stepping its lock-step pipeline with empty batches; the
  share of that step's wall time its attention rank (rank 0) spends in attention spans.
* ``decode_cpu_share``: a launch's decode ranks' CPU seconds (``cpu_s``) per second of the job
  and per rank: in a long-prompt PD job the pool has nothing to decode most of the time, so
  this is (an upper bound of) what an idle decode rank takes from the shared cores.
* ``step_stats``: median prefill step (prefill lane), median decode iteration with tokens
  (first span start to last span end over the decode ranks), mean chunk iteration of a
  baseline (iterations whose micro-batches hold more than ``max_decode`` tokens).
"""
from __future__ import annotations

import collections
import statistics


def idle_decode_busy(spans: list) -> float | None:
    pre = sorted((x for x in spans if x[1] == "prefill"), key=lambda x: x[6])
    if not pre:
        return None
    t0, t1 = pre[0][6], pre[0][6] + pre[0][7]
    busy = sum(x[7] for x in spans if x[0] == 0 and x[1] == "attention" and x[5] == 0
               and t0 <= x[6] and x[6] + x[7] <= t1)
    return busy / (t1 - t0) if t1 > t0 else None


def decode_cpu_share(run: dict) -> float | None:
    cpu = [c for role, c in run.get("cpu_s") or [] if role in ("attention", "expert")]
    return sum(cpu) / (run["seconds"] * len(cpu)) if cpu and run.get("seconds") else None


def _iterations(spans: list) -> dict:
    """iteration -> (tokens of its attention spans, wall ms) over the attention / expert spans."""
    it = collections.defaultdict(lambda: [0, float("inf"), 0.0])
    for x in spans:
        if x[1] in ("attention", "expert"):
            v = it[x[2]]
            if x[1] == "attention":
                v[0] += x[5]
            v[1], v[2] = min(v[1], x[6]), max(v[2], x[6] + x[7])
    return {k: (v[0], v[2] - v[1]) for k, v in it.items()}


def step_stats(spans: list, layers: int, max_decode: int) -> dict:
    pre = [x[7] for x in spans if x[1] == "prefill"]
    its = _iterations(spans)
    tokens = {k: tok / layers for k, (tok, _) in its.items()}  # per iteration, all micro-batches
    dec = [w for k, (tok, w) in its.items() if 0 < tokens[k] <= max_decode]
    chunk = [w for k, (tok, w) in its.items() if tokens[k] > max_decode]
    return {"prefill_step_ms": statistics.median(pre) if pre else None,
            "decode_iter_ms": statistics.median(dec) if dec else None,
            "chunk_iter_ms": statistics.mean(chunk) if chunk else None}
