"""Which prefill TP rank sends which KV heads to which decode TP rank (docs/pd.md).

A prefill replica of ``src_tp`` ranks and a decode replica of ``dst_tp`` ranks each split the KV
heads as ``layers.SelfAttention`` does (``models.kv_spec.kv_head_slice``: contiguous slices, one
head replicated over several ranks when tp > heads). Decode TP rank t needs the heads of its slice; each of them
comes from the lowest prefill TP rank holding it, and consecutive heads from the same prefill
rank travel as one message. Both sides compute the same routes from the plan, so nothing about
them is negotiated at run time. MLA caches the latent shared by every head: prefill TP rank 0's
copy goes whole to every decode TP rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megainfer.models.kv_spec import kv_head_slice


@dataclass(frozen=True)
class Route:
    src: int  # prefill TP rank
    first: Optional[int]  # first global KV head; None: the whole MLA latent
    count: Optional[int]  # KV heads

    def sender_heads(self, num_kv_heads: int, src_tp: int) -> Optional[tuple[int, int]]:
        """(first, count) of the route's heads in the sender's own cache (None: all)."""
        if self.first is None:
            return None
        return self.first - kv_head_slice(num_kv_heads, src_tp, self.src)[0], self.count


def routes_to(kind: str, num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[Route]:
    """The messages decode TP rank ``dst_rank`` receives for one layer segment, in the order of
    its own heads (concatenated, they are its slice)."""
    if kind != "gqa":
        return [Route(0, None, None)]
    first, count = kv_head_slice(num_kv_heads, dst_tp, dst_rank)
    out: list[Route] = []
    for g in range(first, first + count):
        s = min(s for s in range(src_tp) if _holds(num_kv_heads, src_tp, s, g))
        if out and out[-1].src == s:
            out[-1] = Route(s, out[-1].first, out[-1].count + 1)
        else:
            out.append(Route(s, g, 1))
    return out


def _holds(num_kv_heads: int, tp: int, rank: int, head: int) -> bool:
    a, n = kv_head_slice(num_kv_heads, tp, rank)
    return a <= head < a + n


def check_prefill_tp(num_heads: int, num_kv_heads: int, is_mla: bool, tp: int,
                     num_experts: Optional[int] = None) -> Optional[str]:
    """Why ``deploy.prefill_tp`` cannot split this model's attention (or its experts), or None."""
    if num_experts is not None and tp > num_experts:
        return f"must be at most num_experts={num_experts} (the experts are split over it)"
    if num_heads % tp:
        return f"must divide num_heads={num_heads}"
    if not is_mla and num_kv_heads % tp and tp % num_kv_heads:
        return f"must divide or be a multiple of num_kv_heads={num_kv_heads}"
    return None
