"""The serving target ``deploy=auto`` plans for (``slo.*``; docs/perfmodel.md, "Planning a
server")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import is_number, require


@dataclass(frozen=True)
class SloConfig:
    """With ``arrival_rate`` set, ``deploy=auto`` over N > 1 ranks simulates AE and PD splits
    of the N ranks on ``num_requests`` Poisson requests of ``input_len`` / ``output_len``
    tokens at that rate and runs the one that best meets the TTFT and TPOT SLOs at
    ``percentile``; null: it runs the offline job's fastest decode split."""

    arrival_rate: Optional[float] = None  # requests/s to plan for; null: the offline job's throughput
    input_len: int = 512  # prompt tokens of the planned requests
    output_len: int = 128  # output tokens of the planned requests
    ttft_ms: float = 2000.0  # time to first token the plan must meet
    tpot_ms: float = 150.0  # time per output token the plan must meet
    percentile: float = 90.0  # this % of the planned requests must meet both
    num_requests: int = 64  # Poisson requests simulated per candidate plan

    def __post_init__(self):
        require(self.arrival_rate is None or (is_number(self.arrival_rate) and self.arrival_rate > 0),
                "slo.arrival_rate", self.arrival_rate, "must be a positive number of requests/s "
                "or null")
        for name in ("input_len", "output_len", "num_requests"):
            v = getattr(self, name)
            require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"slo.{name}", v,
                    "must be an integer >= 1")
        for name in ("ttft_ms", "tpot_ms"):
            v = getattr(self, name)
            require(is_number(v) and v > 0, f"slo.{name}", v, "must be a positive number of "
                    "milliseconds")
        require(is_number(self.percentile) and 0 < self.percentile <= 100, "slo.percentile",
                self.percentile, "must be in (0, 100]")

    @property
    def plans_serving(self) -> bool:
        return self.arrival_rate is not None
