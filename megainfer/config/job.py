"""``ResolvedJob``: every resolved group of one job in one frozen bundle. ``resolve.resolve_job``
makes it for ``LLM`` and the launcher alike; every rank of the distributed runtime builds its
part from it (``megainfer/runtime``); the launcher's ``JobSettings`` is this plus the groups only
the offline job reads (sampling defaults, io, workload)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import require
from .model import ModelConfig
from .pd import PdConfig
from .replan import ReplanConfig
from .slo import SloConfig
from .runtime import (CacheConfig, CommConfig, DeployPlan, DeviceConfig, EplbConfig, LoadConfig,
                      SchedulerConfig, TraceConfig)


@dataclass(frozen=True)
class ResolvedJob:
    model: ModelConfig
    load: LoadConfig
    scheduler: SchedulerConfig
    cache: CacheConfig
    deploy: DeployPlan = DeployPlan()
    comm: CommConfig = CommConfig()
    eplb: EplbConfig = EplbConfig()
    trace: TraceConfig = TraceConfig()
    seed: int = 0  # requests without their own seed draw from it (sampling.seed)
    device: DeviceConfig = DeviceConfig()  # cuda: every rank on GPU local_rank % visible
    replan: ReplanConfig = ReplanConfig()  # online re-planning (docs/replan.md)
    slo: SloConfig = SloConfig()  # what deploy=auto plans a server for (docs/perfmodel.md)
    pd: PdConfig = PdConfig()  # prefill-decode options: decode attention offload (docs/pd.md)
    cpu_threads: Optional[int] = None  # torch intra-op threads of this process; None: torch's

    def __post_init__(self):
        require(isinstance(self.seed, int) and not isinstance(self.seed, bool), "sampling.seed",
                 self.seed, "must be an integer")
        require(self.cpu_threads is None or (isinstance(self.cpu_threads, int)
                                              and not isinstance(self.cpu_threads, bool)
                                              and self.cpu_threads >= 1),
                 "deploy.cpu_threads", self.cpu_threads, "must be a positive integer or null")
        if self.pd.offload:
            require(self.deploy.prefill_replicas > 0, "pd.offload", self.pd.offload,
                    "needs prefill ranks (deploy.prefill_replicas > 0)")
