"""The analytic model of a PD split's two halves: the prefill pool and the decode pool it feeds.

* ``PrefillPool``: ``n_p`` prefill replicas, each a whole-model TP group of ``tp_p`` devices
  (its layer times: the profile's, or its own ``times``; ``t_prefill`` of one prompt of P
  tokens: the closed form's per-layer attention at mean context P / 2 plus every expert's share
  of the P * top_k token slots plus ``prompt_host_s``, times the layers, plus the lm_head;
  ``serve``: one prompt at a time per replica, FCFS, the goodput search's cheap TTFT prune).
* ``kv_transfer_s``: one request's KV cache (P * KV bytes per token) over one link of the
  slower side's inter-node bandwidth (no contention between transfers).
* ``decode_model``: the decode pool's ``DisaggModel``, its attention optionally seeing
  ``prompt_shift`` more context tokens (requests arrive with their prompt already cached).
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import DisaggModel, Workload
from megainfer.perfmodel.model.hardware import HardwareProfile
from megainfer.perfmodel.model.layer_times import layer_times_for
from megainfer.perfmodel.model.shapes import ModelShape


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
        return s.total_weight_bytes(self.dtype) / self.tp_p + kv

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
