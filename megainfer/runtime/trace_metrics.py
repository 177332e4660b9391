"""Pipeline figures read off a merged trace (``docs/trace_format.md``).

* ``T_a``: median attention span of one (layer, micro-batch) on an attention rank.
* ``T_e``: median expert span of one (layer, micro-batch) on an expert rank (colocated: on any).
* ``T_c``: median one-way A2E latency, from the leader's dispatch end to the moment a blocked
  expert rank had the message (observable only when an expert rank was waiting).
* ``hidden``: the fraction of each micro-batch's round trip (dispatch end -> combine end:
  transfer both ways plus expert compute) during which the attention rank was not blocked in
  combine, i.e. did other work. m = 1 gives ~0; a balanced m >= 2 pipeline approaches 1.
* ``bubble``: per compute lane, the fraction of the iteration window the lane sat idle.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

from megainfer.perfmodel.trace import (A2E, ATTENTION, COMBINE, DISPATCH, E2A, EXPERT,
                                       is_moe_attention, is_wait)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def pipeline_metrics(trace: dict) -> dict:
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    mode = trace.get("metadata", {}).get("mode", "disaggregated")
    send_lane, recv_lane = (DISPATCH, COMBINE) if mode == "colocated" else (A2E, E2A)
    attention_ranks = {e["pid"] for e in ev if e["cat"] == ATTENTION}
    key = lambda e: (e["args"]["iter"], e["args"]["layer"], e["args"]["mb"])  # noqa: E731
    t_a = [e["dur"] for e in ev if is_moe_attention(e)]
    t_e = [e["dur"] for e in ev if e["cat"] == EXPERT]
    dispatch_end, round_trip, blocked = {}, [], []
    for e in ev:
        if e["cat"] == send_lane and e["pid"] in attention_ranks and not is_wait(e):
            dispatch_end[(e["pid"],) + key(e)] = e["ts"] + e["dur"]
    for e in ev:
        if e["cat"] == recv_lane and e["pid"] in attention_ranks:
            start = dispatch_end.get((e["pid"],) + key(e))
            if start is not None:
                end = e["ts"] + e["dur"]
                round_trip.append(end - start)
                blocked.append(e["dur"])
    lat = []
    by_key = defaultdict(list)
    for k, end in dispatch_end.items():
        by_key[k[1:]].append(end)
    for e in ev:  # expert ranks' receive waits: the message arrived at the wait's end
        if e["cat"] == A2E and is_wait(e) and e["dur"] > 0:
            ends = by_key.get(key(e))
            if ends:
                lat.append(e["ts"] + e["dur"] - max(ends))
    lat = [x for x in lat if x > 0]
    total_rt = sum(round_trip)
    return {
        "mode": mode,
        "T_a_us": _median(t_a), "T_e_us": _median(t_e), "T_c_us": _median(lat),
        "hidden_fraction": (1 - sum(blocked) / total_rt) if total_rt > 0 else float("nan"),
        "bubble_fraction": _bubbles(ev),
        "events": len(ev),
    }


def _bubbles(ev) -> dict:
    """{'<lane> rank <pid>': idle fraction of that rank's iteration windows} for compute lanes."""
    spans = defaultdict(lambda: [float("inf"), 0.0])  # (pid, iter) -> [first ts, last end]
    busy = defaultdict(float)  # (pid, lane) -> busy us
    for e in ev:
        s = spans[(e["pid"], e["args"]["iter"])]
        s[0], s[1] = min(s[0], e["ts"]), max(s[1], e["ts"] + e["dur"])
        if e["cat"] in (ATTENTION, EXPERT):
            busy[(e["pid"], e["cat"])] += e["dur"]
    window = defaultdict(float)
    for (pid, _), (a, b) in spans.items():
        window[pid] += b - a
    return {f"{lane} rank {pid}": round(1 - t / window[pid], 4) if window[pid] else float("nan")
            for (pid, lane), t in sorted(busy.items())}
