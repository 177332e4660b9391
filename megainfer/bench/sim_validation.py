"""What ``perf/validate/validate_sim.py`` reads off a runtime job: its measured TTFT / TPOT /
throughput (``measured_summary``), a traced run's prefill spans (``prefill_samples``) and hops
(``hop_gaps``), and the host terms those give (``host_terms``: the node's wake-up latency, the
host work per iteration); the PD validation reads its calibration runs the same way."""
from __future__ import annotations

import numpy as np


def measured_summary(run: dict) -> dict:
    a = np.array([r["arrival_s"] for r in run["requests"]])
    ft = np.array([r["first_token_s"] for r in run["requests"]])
    fs = np.array([r["finish_s"] for r in run["requests"]])
    n = np.array([r["output_len"] for r in run["requests"]])
    tpot = ((fs - ft) / np.maximum(n - 1, 1))[n > 1]
    return {"ttft_s_p50": float(np.median(ft - a)), "tpot_s_p50": float(np.median(tpot)),
            "throughput_tok_s": float(n.sum() / (fs.max() - a.min()))}


def prefill_samples(trace: dict, prompt_len: int, top_k: int) -> tuple[list, list]:
    """The prefill iteration's spans (iteration 0: every prompt in one chunk, mean context
    (P + 1) / 2), in ``insitu.layer_samples``' format; the decode ones alone never see chunks
    of hundreds of tokens, which the jobs here prefill."""
    attn, expert = [], []
    for e in trace["traceEvents"]:
        a = e.get("args", {})
        if e.get("ph") != "X" or a.get("iter", -1) != 0 or a.get("tokens", 0) <= 0:
            continue
        if e["cat"] == "attention" and e["name"].startswith("attn"):
            attn.append((a["tokens"], (prompt_len + 1) / 2, e["dur"] / 1e6))
        elif e["cat"] == "expert":
            expert.append((a["tokens"] * top_k, e["dur"] / 1e6))
    return attn, expert


def hop_gaps(trace: dict) -> list:
    """(tokens, seconds) of every A2E / E2A hop of the decode iterations of a 1 + 1 rank, m = 1
    traced run: from the end of one side's compute span to the start of the other side's next
    one (message transfer + the receiver noticing it + the host's exchange code); and of every
    gap between iterations (host work: sampling, scheduling, the next step's inputs)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["args"]["tokens"], e["args"]["iter"])
                   for e in trace["traceEvents"]
                   if e.get("ph") == "X" and e["cat"] in ("attention", "expert")
                   and e.get("args", {}).get("iter", 0) >= 1 and e["args"].get("tokens", 0) > 0)
    hops, steps = [], []  # steps: from an iteration's last span to the next one's first
    for (_, a1, tok, i), (b0, _, _, j) in zip(spans, spans[1:]):
        (hops if i == j else steps).append((tok, (b0 - a1) / 1e6))
    return hops, steps


def host_terms(hops: list, steps: list, link, bytes_per_token: float) -> dict:
    """The node's wake-up latency and host work per iteration from ``hop_gaps``' (tokens,
    seconds) lists: wake = median over the hops of (gap - the link's time for that message,
    ``bytes_per_token`` a token); iteration overhead = median gap between iterations - that
    median (sampling, scheduling, the next step's inputs)."""
    wake = float(np.median([g - link.time(tok * bytes_per_token) for tok, g in hops]))
    return {"wake_latency_s": max(0.0, wake),
            "iteration_overhead_s": max(0.0, float(np.median([g for _, g in steps])) - wake)}
