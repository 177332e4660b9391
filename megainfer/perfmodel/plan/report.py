"""Plan tables as text and as JSON-able dicts."""
from __future__ import annotations

from dataclasses import asdict

from megainfer.perfmodel.model.colocated import ColocatedPrediction
from megainfer.perfmodel.plan.planner import GiB, Ranked

HEADER = (f"{'#':>2} {'plan':<40} {'T_a ms':>8} {'T_e ms':>8} {'T_c ms':>8} {'m':>2} {'B':>7} "
          f"{'TPOT ms':>8} {'tok/s':>9} {'tok/s/dev':>9} {'Mtok/$':>8}  binding")


def row(i: int, r: Ranked) -> str:
    p = r.pred
    if isinstance(p, ColocatedPrediction):
        ta = te = tc = "-"
        label = p.plan.label()
    else:
        ta, te, tc = (f"{x * 1e3:8.3f}" for x in (p.t_a, p.t_e, p.t_c))
        label = p.plan.label()
    return (f"{i:>2} {label:<40} {ta:>8} {te:>8} {tc:>8} {p.plan.m:>2} {p.plan.batch:>7} "
            f"{p.t_iter * 1e3:8.2f} {p.tokens_per_s:9.0f} {p.tokens_per_s_per_device:9.1f} "
            f"{p.tokens_per_dollar / 1e6:8.3f}  {r.binding}")


def table(ranked: list[Ranked], top: int = 10) -> str:
    return "\n".join([HEADER] + [row(i, r) for i, r in enumerate(ranked[:top])])


def as_dict(r: Ranked) -> dict:
    p = r.pred
    d = {"plan": asdict(p.plan), "label": p.plan.label(), "tpot_s": p.t_iter,
         "tokens_per_s": p.tokens_per_s, "tokens_per_s_per_device": p.tokens_per_s_per_device,
         "tokens_per_dollar": p.tokens_per_dollar, "binding": r.binding}
    if not isinstance(p, ColocatedPrediction):
        d.update(t_a=p.t_a, t_e=p.t_e, t_c=p.t_c, t_total=p.t_total, t_head=p.t_head,
                 mem_attn=p.mem_attn, mem_expert=p.mem_expert)
    else:
        d.update(mem=p.mem)
    return d


def weights_line(shape, dtype: str) -> str:
    """The weights' format and size: what the memory fit counts."""
    fmt = shape.quantization or dtype
    return (f"[plan] weights: {fmt} ({shape.quant_weight_bytes(dtype):.5g} B per quantised "
            f"weight; embeddings, lm_head, routers in {dtype}), "
            f"{shape.total_weight_bytes(dtype) / GiB:.4g} GiB in all")


def memory_line(side: str, weights: float, used: float, cap: float, per_seq: float,
                seq_tokens: int) -> str:
    """One device's bytes: weights, the KV room they leave (in sequences of ``seq_tokens``)
    and what the plan's batch uses of it."""
    room = cap - weights
    seqs = f" = {int(room // per_seq)} sequences of {seq_tokens} tokens" if per_seq > 0 else ""
    return (f"[plan] {side} device: weights {weights / GiB:.4g} GiB of {cap / GiB:.4g} GiB "
            f"usable; KV room left {room / GiB:.4g} GiB{seqs}; the plan's batch uses "
            f"{(used - weights) / GiB:.4g} GiB")
