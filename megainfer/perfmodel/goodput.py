"""SLOs, goodput, the prefill pool, and a PD split's simulation.

* ``Slo`` (``slo.ttft_ms``, ``slo.tpot_ms``, ``slo.percentile``) and ``attainment``: a request
  meets the SLOs when its TTFT and its TPOT are both within them (a one-token output has no
  TPOT and meets that half; an unfinished request meets neither). Goodput is requests meeting
  both per second of offered load (met / arrival span; an all-at-once batch: met / makespan).
  A plan *attains* the SLOs when at least ``percentile`` % of the requests meet both.
* ``PrefillPool``: ``n_p`` prefill replicas, each a whole-model TP group of ``tp_p`` devices
  (its layer times: the profile's, or its own ``times``; ``t_prefill`` of one prompt of P
  tokens: the closed form's per-layer attention at mean context P / 2 plus every expert's share
  of the P * top_k token slots plus ``prompt_host_s``, times the layers, plus the lm_head;
  ``serve``: one prompt at a time per replica, FCFS, the search's cheap TTFT prune).
* ``simulate_pd``: a PD plan as one simulation (``pd_sim.simulate_pd_job``: prefill replicas
  with their own chunked-prefill schedulers, KV transfers sharing links, the decode pool, on
  one clock).
* ``simulate_pd_composed``: the older model, kept as its baseline: the prefill pool's queue at
  the arrival times gives each request's first token; its KV cache (P * KV bytes per token)
  then crosses one link of the slower side's inter-node bandwidth (no contention between
  transfers), and the request joins the decode pool (``job_sim.simulate_job`` on the decode
  plan) as a 1-token prompt with output_len - 1 tokens to go; the decode pool's attention sees
  the prompt's context through a context shift of the mean prompt length (``decode_model``'s
  ``prompt_shift``). TTFT = prefill wait + prefill; TPOT = (decode finish - first token) /
  (output_len - 1), KV transfer and decode queueing included.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from megainfer.config import ConfigError
from megainfer.perfmodel.events import Requests
from megainfer.perfmodel.hardware import HardwareProfile
from megainfer.perfmodel.job_sim import JobConfig, simulate_job
from megainfer.perfmodel.layer_times import layer_times_for
from megainfer.perfmodel.model import DisaggModel, Plan, Workload
from megainfer.perfmodel.pd_sim import simulate_pd_job
from megainfer.perfmodel.shapes import ModelShape


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


class PrefillPool:
    """``n_p`` whole-model prefill replicas of ``tp_p`` devices on ``hw``."""

    def __init__(self, shape: ModelShape, hw: HardwareProfile, n_p: int, tp_p: int,
                 dtype: str = "bfloat16", use_fit: bool = True, times=None, prompt_host_s: float = 0.0):
        """``times``: the replicas' layer times (default: ``hw``'s fit for ``shape``, else its
        roofline), e.g. a fit of prefill chunks (``chunk_times``). ``prompt_host_s``: host seconds
        a step spends per prompt in it and per layer beyond the layer times (the CPU runtime's
        per-prompt work: its layer KV gathered and posted to the decode side, its bookkeeping)."""
        if not (prompt_host_s >= 0 and math.isfinite(prompt_host_s)):
            raise ConfigError(f"prefill prompt_host_s={prompt_host_s!r}: must be a number >= 0")
        self.prompt_host_s = prompt_host_s
        self.shape, self.hw, self.n_p, self.tp_p = shape, hw, n_p, tp_p
        self.t = times if times is not None else layer_times_for(hw, shape, dtype, use_fit)
        self.dtype = dtype

    def label(self) -> str:
        return f"P{self.n_p}x tp{self.tp_p}[{self.hw.name}]"

    @property
    def devices(self) -> int:
        return self.n_p * self.tp_p

    @property
    def cost_per_hour(self) -> float:
        return self.devices * self.hw.price_per_hour

    def mem_need(self, prompt: int) -> float:
        """Bytes per device: all weights split over tp_p, plus one prompt's KV."""
        s = self.shape
        kv = prompt * s.kv_bytes_per_token(self.dtype, self.tp_p)
        return s.total_params() * self.t.wb / self.tp_p + kv

    def t_prefill(self, prompt: float) -> float:
        s, tp, p = self.shape, self.tp_p, float(prompt)
        per_layer = (self.t.t_attn(p, p / 2, tp)
                     + self.t.t_expert([p * s.top_k / s.num_experts] * s.num_experts, tp))
        return s.num_layers * (per_layer + self.prompt_host_s) + self.t.t_head(1, tp)

    def serve(self, arrival_s: np.ndarray, prompt_len: np.ndarray) -> np.ndarray:
        """FCFS over the first free replica: when each request's prefill (first token) is done."""
        cache: dict = {}
        free = [0.0] * self.n_p
        heapq.heapify(free)
        done = np.empty(len(arrival_s))
        for k in np.argsort(arrival_s, kind="stable"):
            p = int(prompt_len[k])
            if p not in cache:
                cache[p] = self.t_prefill(p)
            start = max(heapq.heappop(free), float(arrival_s[k]))
            done[k] = start + cache[p]
            heapq.heappush(free, done[k])
        return done


def kv_transfer_s(shape: ModelShape, prompt_len: np.ndarray, pool: PrefillPool,
                  hw_decode: HardwareProfile, tp_decode: int, dtype: str) -> np.ndarray:
    """One request's KV cache from its prefill replica to its decode replica (tp NICs each)."""
    bw = min(pool.hw.inter_link.bandwidth_Bps * pool.tp_p,
             hw_decode.inter_link.bandwidth_Bps * tp_decode)
    lat = max(pool.hw.inter_link.latency_s, hw_decode.inter_link.latency_s)
    return lat + prompt_len * shape.kv_bytes_per_token(dtype) / bw


class _ContextShift:
    """Layer times whose attention sees ``shift`` more context tokens (a decode pool's requests
    arrive with their prompt already in the KV cache)."""

    def __init__(self, inner, shift: float):
        self._inner, self._shift = inner, shift

    def t_attn(self, b: float, ctx: float, tp: int = 1) -> float:
        return self._inner.t_attn(b, ctx + self._shift, tp)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def decode_model(shape: ModelShape, hw_a: HardwareProfile, hw_e: HardwareProfile,
                 workload: Workload, dtype: str, use_fit: bool, prompt_shift: float = 0.0,
                 times: tuple | None = None) -> DisaggModel:
    """``times``: (attention, expert) layer times to use instead of the profiles' own."""
    ta, te = times or (layer_times_for(hw_a, shape, dtype, use_fit), layer_times_for(hw_e, shape, dtype, use_fit))
    return DisaggModel(shape, _ContextShift(ta, prompt_shift) if prompt_shift else ta, te,
                       workload, dtype)


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
                cfg: JobConfig, dtype: str) -> JobTimes:
    """A PD plan as one simulation (``pd_sim.simulate_pd_job``: prefill replicas, KV transfers
    sharing links, the decode pool, on one clock); ``model`` without a context shift."""
    r = simulate_pd_job(pool, model, plan, reqs, cfg, dtype)
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
