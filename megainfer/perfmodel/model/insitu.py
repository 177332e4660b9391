"""Layer-time fits read off traced runtime runs ("in-situ" calibration).

Inside the runtime the layers run slower than ``layer_bench`` times them alone, so this fits
the same k1..k4 to the spans of traced runs of the disaggregated runtime (1 attention + 1
expert rank, m = 1, so no two ranks compute at once):

* attention: every decode ``attn`` span, b tokens at context ctx (prompt + iteration):
  ``T_a = k2 + b * (k1 + k1_ctx * ctx)``;
* experts: every ``expert`` span, all E experts on the rank receiving ``tokens`` (token,
  expert) pairs: ``T_e = E * k4 + k3 * tokens``, as ``FittedTimes.t_expert`` sums them.
Runs launched by ``perf/validate/calibrate_in_situ.py``; docs/perfmodel.md, "Validation".
"""
from __future__ import annotations

from megainfer.config import ConfigError

from megainfer.perfmodel.model.fit import fit_attention, fit_line
from megainfer.perfmodel.trace import EXPERT, is_moe_attention


def layer_samples(trace: dict, prompt_len: int, top_k: int) -> tuple[list, list]:
    """Decode-iteration spans of one merged trace (docs/trace_format.md).

    Returns (attention [(b, ctx, seconds)], expert [(pairs, seconds)]): iteration 0 is the
    prefill (skipped); in iteration i >= 1 a sequence has prompt_len + i tokens, and the
    expert span of b tokens carries b * top_k (token, expert) pairs.
    """
    attn, expert = [], []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        a = e.get("args", {})
        it, n = a.get("iter", 0), a.get("tokens", 0)
        if it < 1 or n <= 0:
            continue
        if is_moe_attention(e):
            attn.append((n, prompt_len + it, e["dur"] / 1e6))
        elif e["cat"] == EXPERT:
            expert.append((n * top_k, e["dur"] / 1e6))
    return attn, expert


def fit_in_situ(attn: list, expert: list, experts_on_rank: int) -> dict:
    """k1, k1_ctx, k2, k3, k4 (seconds) from the samples of ``layer_samples``."""
    if len({b for b, _, _ in attn}) < 2 or len({p for p, _ in expert}) < 2:
        raise ConfigError("in-situ calibration needs runs at >= 2 batch sizes "
                          f"(got attention b={sorted({b for b, _, _ in attn})})")
    k1, k1c, k2 = fit_attention(*zip(*attn), relative=True)
    k3, intercept = fit_line(*zip(*expert), relative=True)
    return {"k1": k1, "k1_ctx": k1c, "k2": k2, "k3": k3, "k4": intercept / experts_on_rank}


def fit_error(fit: dict, attn: list, expert: list, experts_on_rank: int) -> dict:
    """Max and median relative error of the fit on its own samples (a sanity check)."""
    def rel(pred, t):
        return abs(pred - t) / t
    ea = sorted(rel(fit["k2"] + b * (fit["k1"] + fit["k1_ctx"] * c), t) for b, c, t in attn)
    ee = sorted(rel(experts_on_rank * fit["k4"] + fit["k3"] * p, t) for p, t in expert)
    return {"attention": {"max": ea[-1], "median": ea[len(ea) // 2]},
            "expert": {"max": ee[-1], "median": ee[len(ee) // 2]}}
