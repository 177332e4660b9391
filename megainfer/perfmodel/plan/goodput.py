"""SLOs, goodput, and a PD or AE plan's job times against them.

* ``Slo`` and ``attainment``: a request meets the SLOs when its TTFT and its TPOT are both
  within them (a one-token output has no TPOT; an unfinished request meets neither). Goodput
  is requests meeting both per second of arrival span (an all-at-once batch: makespan). A
  plan attains the SLOs when at least ``percentile`` % of the requests meet both.
* ``simulate_ae``: an AE plan through ``sim.job.simulate_job``.
* ``simulate_pd``: a PD plan as one simulation (``sim.pd.simulate_pd_job``).
* ``simulate_pd_composed``: its baseline, the prefill pool's queue, then each KV transfer,
  then the decode pool as a separate job with a context shift of the mean prompt.
docs/perfmodel.md, "Goodput planning".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import DisaggModel, Plan
from megainfer.perfmodel.model.prefill_pool import PrefillPool, kv_transfer_s
from megainfer.perfmodel.sim.events import Requests
from megainfer.perfmodel.sim.job import JobConfig, simulate_job
from megainfer.perfmodel.sim.pd import simulate_pd_job
from megainfer.perfmodel.sim.pd_offload import Offload


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float
    percentile: float = 90.0

    def __post_init__(self):
        for key, v in (("slo.ttft_ms", self.ttft_s), ("slo.tpot_ms", self.tpot_s)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{key}={v * 1e3 if isinstance(v, (int, float)) else v!r}: "
                                  "must be a positive number of milliseconds")
        p = self.percentile
        if not (isinstance(p, (int, float)) and 0 < p <= 100):
            raise ConfigError(f"slo.percentile={p!r}: must be in (0, 100]")


@dataclass(frozen=True)
class Attainment:
    requests: int
    met: int  # requests meeting both SLOs
    ttft_p: float  # the SLO percentile of TTFT (inf when unfinished requests reach it)
    tpot_p: float
    goodput_req_s: float
    percentile: float

    @property
    def fraction(self) -> float:
        return self.met / self.requests if self.requests else 0.0

    @property
    def ok(self) -> bool:
        return self.fraction >= self.percentile / 100 - 1e-12

    def missed_bound(self, slo: Slo) -> str:
        """The SLO the percentile misses by more (``TTFT`` or ``TPOT``)."""
        return "TTFT" if self.ttft_p / slo.ttft_s >= self.tpot_p / slo.tpot_s else "TPOT"


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(np.where(np.isnan(x), np.inf, x), q, method="higher")) if len(x) else math.inf


def attainment(arrival_s: np.ndarray, ttft_s: np.ndarray, tpot_s: np.ndarray,
               finish_s: np.ndarray, slo: Slo) -> Attainment:
    done = ~np.isnan(ttft_s) & ~np.isnan(finish_s)
    ok_tpot = np.isnan(tpot_s) | (tpot_s <= slo.tpot_s)
    met = done & (np.nan_to_num(ttft_s, nan=np.inf) <= slo.ttft_s) & ok_tpot
    span = float(arrival_s.max() - arrival_s.min()) if len(arrival_s) else 0.0
    if span <= 0:
        span = float(np.nanmax(finish_s) - arrival_s.min()) if done.any() else math.inf
    tpot = np.where(done, np.nan_to_num(tpot_s, nan=0.0), np.nan)  # 1-token outputs: TPOT 0
    return Attainment(len(arrival_s), int(met.sum()), _pct(np.where(done, ttft_s, np.nan), slo.percentile),
                      _pct(tpot, slo.percentile), int(met.sum()) / span if span > 0 else 0.0,
                      slo.percentile)


@dataclass(frozen=True)
class JobTimes:
    arrival_s: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    finish_s: np.ndarray


def simulate_ae(model: DisaggModel, plan: Plan, reqs: Requests, cfg: JobConfig) -> JobTimes:
    r = simulate_job(model, plan, reqs, cfg)
    return JobTimes(r.arrival_s, r.ttft_s, r.tpot_s, r.finish_s)


def simulate_pd(pool: PrefillPool, model: DisaggModel, plan: Plan, reqs: Requests,
                cfg: JobConfig, dtype: str, offload: Offload = Offload(),
                decode_kv_tokens: int | None = None) -> JobTimes:
    """A PD plan as one simulation (``pd.simulate_pd_job``: prefill replicas, KV transfers
    sharing links, the decode pool, on one clock); ``model`` without a context shift;
    ``offload``, ``decode_kv_tokens``: the decode-attention offload (``sim.pd_offload``)."""
    r = simulate_pd_job(pool, model, plan, reqs, cfg, dtype, offload=offload,
                        decode_kv_tokens=decode_kv_tokens)
    return JobTimes(r.arrival_s, r.ttft_s, r.tpot_s, r.finish_s)


def simulate_pd_composed(pool: PrefillPool, model: DisaggModel, plan: Plan, reqs: Requests,
                         cfg: JobConfig, dtype: str) -> JobTimes:
    """The composed PD model (module docstring): ``simulate_pd``'s baseline; ``model`` with
    ``prompt_shift`` = the mean prompt."""
    first = pool.serve(reqs.arrival_s, reqs.prompt_len)
    ready = first + kv_transfer_s(pool.shape, reqs.prompt_len, pool, model.hw_a, plan.tp_a, dtype)
    fin = first.copy()
    multi = np.flatnonzero(reqs.output_len > 1)
    if len(multi):
        o = multi[np.argsort(ready[multi], kind="stable")]
        dec = Requests(ready[o], np.ones(len(o), np.int64), reqs.output_len[o] - 1)
        r = simulate_job(model, plan, dec, cfg)
        fin[o] = r.finish_s
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(reqs.output_len > 1, (fin - first) / (reqs.output_len - 1), np.nan)
    return JobTimes(reqs.arrival_s, first - reqs.arrival_s, tpot, fin)
