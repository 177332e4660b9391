"""Prefill-decode disaggregation's options beyond the rank split (``pd.*``; docs/pd.md,
"Decode attention offloaded to the prefill ranks")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import is_number, require

OFFLOAD_POLICIES = ("ratio", "auto")  # pd.offload_policy; the rule: perfmodel/offload_rule.py


@dataclass(frozen=True)
class PdConfig:
    """``offload``: a request prefilled on a prefill rank may keep its KV there, and every
    decode step runs its attention there (Adrenaline); the decode rank computes q/k/v, O
    projection and the MoE for it. Off by default; needs ``deploy.prefill_replicas > 0``. In
    the config tree ``pd.offload`` may be null (unset): ``deploy=auto`` planning a server then
    chooses it and its ratio (``perfmodel/plan/serving_plan.py``), else it resolves to false."""

    # decode attention of some requests runs on the prefill rank holding their KV; null (unset): deploy=auto's choice when it plans a server (slo.arrival_rate), else false
    offload: bool = False
    # fraction of the eligible requests offloaded (0: none, 1: every one the prefill rank's offload pool has room for)
    offload_ratio: float = 1.0
    # KV blocks of a prefill rank's cache kept for offloaded requests (the rest holds prompts in flight); null: half of cache.num_blocks
    offload_blocks: Optional[int] = None
    # ratio: offload_ratio of the eligible requests; auto: only while the prefill rank's pool has room and the decode replica's KV would not hold the request
    offload_policy: str = "ratio"
    # a request the policy would offload whose prefill rank's pool is short sends requests decoding from that pool home (their KV moved to their decode replica, which must hold their whole lives)
    offload_return_home: bool = True
    # auto: a prefill rank whose measured busy share (its prefill steps and the offloaded attention it serves, over the last second) exceeds this takes no more offloaded requests
    offload_max_prefill_busy: float = 0.9

    def __post_init__(self):
        require(isinstance(self.offload, bool), "pd.offload", self.offload, "must be true or false")
        require(is_number(self.offload_ratio) and 0 <= self.offload_ratio <= 1,
                "pd.offload_ratio", self.offload_ratio, "must be a number in [0, 1]")
        require(self.offload_blocks is None or (isinstance(self.offload_blocks, int)
                                                and not isinstance(self.offload_blocks, bool)
                                                and self.offload_blocks >= 1),
                "pd.offload_blocks", self.offload_blocks, "must be an integer >= 1 or null")
        require(isinstance(self.offload_return_home, bool), "pd.offload_return_home",
                self.offload_return_home, "must be true or false")
        require(is_number(self.offload_max_prefill_busy) and 0 < self.offload_max_prefill_busy <= 1,
                "pd.offload_max_prefill_busy", self.offload_max_prefill_busy,
                "must be a number in (0, 1]")
        require(self.offload_policy in OFFLOAD_POLICIES, "pd.offload_policy", self.offload_policy,
                f"must be one of {', '.join(OFFLOAD_POLICIES)}")

    def pool_blocks(self, num_blocks: int) -> int:
        """The prefill rank's offload pool out of its ``num_blocks`` (0 when off)."""
        if not self.offload:
            return 0
        return num_blocks // 2 if self.offload_blocks is None else self.offload_blocks


def offload_needs(prefill_tp: int, attention_tp: int, is_mla: bool,
                  kv_cache_dtype: str) -> Optional[str]:
    """What ``pd.offload=true`` needs of this split and cache that it lacks for now, in words
    (``<key>=<need> (got <value>)``), or None: the runtime's check where it is built
    (``runtime/pd/build.check_offload``) and the planner's (``deploy=auto`` chooses no offload
    the runtime would refuse)."""
    for ok, key, value, why in (
            (prefill_tp in (1, attention_tp), "deploy.prefill_tp", prefill_tp,
             f"1 or deploy.attention_tp={attention_tp}"),
            (not is_mla or prefill_tp == attention_tp, "deploy.prefill_tp", prefill_tp,
             f"deploy.attention_tp={attention_tp} with MLA"),
            (kv_cache_dtype in (None, "auto"), "cache.kv_cache_dtype", kv_cache_dtype, "auto")):
        if not ok:
            return f"{key}={why} for now (got {value!r})"
    return None
