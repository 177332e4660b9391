"""Online re-planning's section of the config tree (``replan.*``, docs/replan.md)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .base import is_int_at_least, is_number, require

POLICIES = ("measured", "planner")  # who orders the measured switches


@dataclass(frozen=True)
class ReplanConfig:
    """Online re-planning of the attention:expert split (``replan.*``, docs/replan.md). With
    ``enabled``, every ``interval`` iterations rank 0 refits the per-layer model from the
    measured times and switches ranks between the attention and expert roles when the planner
    predicts more than ``min_gain`` (a fraction of the remaining job time) after the switch's
    own cost. ``force_schedule``: ((iteration, "aNeM"), ...) switches at those iterations
    regardless (tests, benchmarks). ``kv_transfer``: a leaving replica's running requests keep
    their KV (``move``), recompute it (``recompute``), or the cheaper of the two (``auto``).
    ``link_gbps``: the bandwidth the switch cost is counted at. ``micro_batches``: ``plan``
    (a switch may also change the micro-batch count to the planner's best) or ``hold`` (the
    launch's count stays). A forced plan ``aNeMmK`` sets the count to K too. ``policy``:
    ``measured`` (the decisions above) or ``planner``: megainfer-serve's live planner orders
    the switches from the served traffic every ``planner_interval_s`` seconds (the ``slo.*``
    TTFT / TPOT bounds at ``slo.percentile``, ``min_gain`` of goodput over ``horizon_s``
    after ``switch_s`` of nothing served, the same winner ``confirm`` intervals running,
    ``dwell_s`` between two switches; docs/replan.md, "The live planner")."""

    enabled: bool = False  # re-plan the attention:expert split while the job runs
    interval: int = 64
    min_gain: float = 0.10
    force_schedule: tuple = ()
    kv_transfer: str = "auto"
    link_gbps: float = 10.0
    micro_batches: str = "plan"
    policy: str = "measured"  # measured | planner (megainfer-serve's live planner)
    planner_interval_s: float = 10.0  # seconds between the live planner's decisions
    horizon_s: float = 60.0  # the planner judges the goodput over this long
    switch_s: float = 1.0  # what the planner counts a switch as (nothing served)
    dwell_s: float = 60.0  # the least time between two of the planner's switches
    confirm: int = 2  # intervals running the same winner must win before a switch

    def __post_init__(self):
        require(isinstance(self.enabled, bool), "replan.enabled", self.enabled,
                 "must be true or false")
        require(isinstance(self.interval, int) and not isinstance(self.interval, bool)
                 and self.interval >= 1, "replan.interval", self.interval, "must be an integer >= 1")
        require(isinstance(self.min_gain, (int, float)) and not isinstance(self.min_gain, bool)
                 and 0 <= self.min_gain < 1, "replan.min_gain", self.min_gain,
                 "must be a number in [0, 1)")
        require(self.kv_transfer in ("auto", "move", "recompute"), "replan.kv_transfer",
                 self.kv_transfer, "must be auto, move or recompute")
        require(self.micro_batches in ("plan", "hold"), "replan.micro_batches",
                 self.micro_batches, "must be plan or hold")
        require(isinstance(self.link_gbps, (int, float)) and not isinstance(self.link_gbps, bool)
                 and self.link_gbps > 0, "replan.link_gbps", self.link_gbps, "must be > 0")
        require(self.policy in POLICIES, "replan.policy", self.policy,
                 f"must be one of {', '.join(POLICIES)}")
        for name in ("planner_interval_s", "horizon_s"):
            v = getattr(self, name)
            require(is_number(v) and v > 0, f"replan.{name}", v, "must be a number of seconds > 0")
        for name in ("switch_s", "dwell_s"):
            v = getattr(self, name)
            require(is_number(v) and v >= 0, f"replan.{name}", v,
                    "must be a number of seconds >= 0")
        require(self.horizon_s > self.switch_s, "replan.horizon_s", self.horizon_s,
                 f"must exceed replan.switch_s={self.switch_s}")
        require(is_int_at_least(self.confirm, 1), "replan.confirm", self.confirm,
                 "must be an integer >= 1")
        require(self.policy != "planner" or not self.force_schedule, "replan.policy",
                 self.policy, "planner orders its own switches: leave replan.force_schedule "
                 "empty")
        sched = []
        for item in self.force_schedule or ():
            ok = isinstance(item, (list, tuple)) and len(item) == 2
            it, plan = item if ok else (None, None)
            require(ok and isinstance(it, int) and not isinstance(it, bool) and it >= 1
                     and parse_split(plan) is not None, "replan.force_schedule", item,
                     "each entry must be [iteration >= 1, 'aNeM' or 'aNeMmK'] (e.g. [8, "
                     "'a2e2'] or [8, 'a2e2m3'])")
            sched.append((it, str(plan)))
        its = [it for it, _ in sched]
        require(its == sorted(set(its)), "replan.force_schedule", self.force_schedule,
                 "iterations must be strictly increasing")
        object.__setattr__(self, "force_schedule", tuple(sched))

    @property
    def measured(self) -> bool:
        """Rank 0 decides from the pipeline's measured spans (no forced schedule, no planner):
        the expert ranks then send it their samples every ``interval``."""
        return not self.force_schedule and self.policy == "measured"


def parse_split(label) -> Optional[tuple[int, int]]:
    """'a2e2' or 'a2e2m3' -> (attention replicas, expert ranks); None when it is not such a
    label."""
    p = parse_plan(label)
    return None if p is None else p[:2]


def parse_plan(label) -> Optional[tuple[int, int, Optional[int]]]:
    """'a2e2m3' -> (2, 2, 3); 'a2e2' -> (2, 2, None): the micro-batch count unchanged."""
    m = re.fullmatch(r"a(\d+)e(\d+)(?:m(\d+))?", label) if isinstance(label, str) else None
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1 or m.group(3) == "0":
        return None
    return int(m.group(1)), int(m.group(2)), None if m.group(3) is None else int(m.group(3))
