"""What a simulated job returns (``job.simulate_job``): per-request times and their summary."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megainfer.perfmodel.trace import TraceWriter


@dataclass
class JobResult:
    arrival_s: np.ndarray
    first_token_s: np.ndarray  # NaN: never got one (max_iterations hit)
    finish_s: np.ndarray
    output_len: np.ndarray
    iteration_s: list  # (start, duration, tokens) per iteration
    trace: TraceWriter | None = None

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> np.ndarray:
        """(finish - first token) / (output_len - 1); NaN for 1-token outputs."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.output_len > 1, (self.finish_s - self.first_token_s)
                            / (self.output_len - 1), np.nan)

    @property
    def latency_s(self) -> np.ndarray:
        return self.finish_s - self.arrival_s

    @property
    def makespan_s(self) -> float:
        return float(np.nanmax(self.finish_s) - self.arrival_s.min())

    @property
    def throughput_tok_s(self) -> float:
        done = ~np.isnan(self.finish_s)
        return float(self.output_len[done].sum() / self.makespan_s) if self.makespan_s > 0 else 0.0

    @property
    def throughput_req_s(self) -> float:
        return float((~np.isnan(self.finish_s)).sum() / self.makespan_s) if self.makespan_s > 0 else 0.0

    def summary(self, percentiles=(50, 90, 99)) -> dict:
        out = {"requests": len(self.arrival_s), "finished": int((~np.isnan(self.finish_s)).sum()),
               "iterations": len(self.iteration_s), "makespan_s": self.makespan_s,
               "throughput_tok_s": self.throughput_tok_s, "throughput_req_s": self.throughput_req_s}
        for name, v in (("ttft_s", self.ttft_s), ("tpot_s", self.tpot_s), ("latency_s", self.latency_s)):
            v = v[~np.isnan(v)]
            for q in percentiles:
                out[f"{name}_p{q}"] = float(np.percentile(v, q)) if len(v) else float("nan")
        return out
