"""Inputs and shared resources of the whole-job simulator (``job.py``), all numpy.

* requests: Poisson arrivals at a rate, or a jsonl trace of {arrival_s, prompt_len, output_len};
  prompt / output lengths drawn from ``LengthDist`` (fixed, uniform, lognormal) or the trace;
* ``Routing``: per-expert token counts of each (layer, micro-batch): balanced (the closed form's
  even split), Zipf with an exponent, or a recorded per-expert load vector (e.g. an EPLB window);
* links: ``makespan`` / ``makespan_outer`` (when a work-conserving link has delivered every
  message of a group, vectorised over receivers) and ``fair_share`` (each message's finish
  under processor sharing, for checks).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from megainfer.config import ConfigError


@dataclass(frozen=True)
class LengthDist:
    """fixed: ``value``; uniform: integers in [lo, hi]; lognormal: median ``value``, ``sigma``,
    clipped to [1, hi] (hi = 0: no upper clip)."""

    kind: str = "fixed"
    value: float = 128
    lo: int = 1
    hi: int = 0
    sigma: float = 0.5

    def __post_init__(self):
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ConfigError(f"length.kind={self.kind!r}: must be fixed, uniform or lognormal")
        if not (self.value >= 1 and math.isfinite(self.value)):
            raise ConfigError(f"length.value={self.value!r}: must be >= 1")
        if self.kind == "uniform" and not (1 <= self.lo <= self.hi):
            raise ConfigError(f"length.lo={self.lo!r}, hi={self.hi!r}: need 1 <= lo <= hi")
        if self.sigma < 0 or self.hi < 0:
            raise ConfigError(f"length.sigma={self.sigma!r}, hi={self.hi!r}: must be >= 0")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, int(round(self.value)), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.lo, self.hi + 1, size=n)
        x = np.rint(rng.lognormal(math.log(self.value), self.sigma, size=n))
        return np.clip(x, 1, self.hi if self.hi else None).astype(np.int64)


@dataclass(frozen=True)
class Requests:
    """One job's requests, sorted by arrival (seconds from the start)."""

    arrival_s: np.ndarray
    prompt_len: np.ndarray
    output_len: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival_s)


def _sorted(arr, prompt, out) -> Requests:
    o = np.argsort(arr, kind="stable")
    return Requests(np.asarray(arr, float)[o], np.asarray(prompt, np.int64)[o],
                    np.asarray(out, np.int64)[o])


def poisson_requests(n: int, rate: float, prompt: LengthDist, output: LengthDist,
                     seed: int = 0) -> Requests:
    """``n`` requests with exponential inter-arrival gaps of mean 1/rate (rate <= 0 or inf:
    everything at t = 0, an offline batch)."""
    if not (isinstance(n, int) and n >= 1):
        raise ConfigError(f"workload.num_requests={n!r}: must be an integer >= 1")
    rng = np.random.default_rng(seed)
    if rate > 0 and math.isfinite(rate):
        arr = np.cumsum(rng.exponential(1.0 / rate, size=n))
    else:
        arr = np.zeros(n)
    return _sorted(arr, prompt.sample(rng, n), output.sample(rng, n))


def read_request_trace(path: str) -> Requests:
    """jsonl, one request a line: {"arrival_s": s >= 0, "prompt_len": n >= 1, "output_len": n >= 1};
    blank lines skipped. A malformed line raises ConfigError naming ``path:line``."""
    arr, prompt, out = [], [], []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise ValueError("not a JSON object")
                a, p, o = d["arrival_s"], d["prompt_len"], d["output_len"]
                num = isinstance(a, (int, float)) and not isinstance(a, bool)
                if not (num and a >= 0 and math.isfinite(a)):
                    raise ValueError(f"arrival_s={a!r} must be a number >= 0")
                for k, v in (("prompt_len", p), ("output_len", o)):
                    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                        raise ValueError(f"{k}={v!r} must be an integer >= 1")
            except KeyError as e:
                raise ConfigError(f"{path}:{ln}: missing key {e.args[0]!r} "
                                  f"(need arrival_s, prompt_len, output_len)") from None
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise ConfigError(f"{path}:{ln}: {e}") from None
            arr.append(float(a)), prompt.append(p), out.append(o)
    if not arr:
        raise ConfigError(f"{path}: no requests")
    return _sorted(arr, prompt, out)


@dataclass(frozen=True)
class Routing:
    """How a micro-batch's token slots (tokens * top_k) spread over the experts.

    balanced  every expert gets tokens * top_k / E (fractional: the closed form's b_e)
    zipf      multinomial with p_e ~ 1 / rank^exponent; which experts are hot is a fixed random
              permutation per layer, drawn once per job (hot experts persist across iterations)
    load      multinomial with p_e ~ ``load`` (a recorded per-expert load vector, e.g. an EPLB
              window's counts: shape [E], or [layers, E] one row per layer)
    """

    kind: str = "balanced"
    exponent: float = 1.0
    load: tuple = field(default=())

    def __post_init__(self):
        if self.kind not in ("balanced", "zipf", "load"):
            raise ConfigError(f"routing.kind={self.kind!r}: must be balanced, zipf or load")
        if self.kind == "zipf" and not (self.exponent >= 0 and math.isfinite(self.exponent)):
            raise ConfigError(f"routing.exponent={self.exponent!r}: must be >= 0")
        if self.kind == "load":
            a = np.asarray(self.load, float)
            if a.ndim not in (1, 2) or a.size == 0 or (a < 0).any() or (a.sum(axis=-1) <= 0).any():
                raise ConfigError("routing.load: must be a non-negative [E] or [layers, E] vector "
                                  "with a positive sum per row")

    def probabilities(self, layers: int, num_experts: int, rng: np.random.Generator) -> np.ndarray | None:
        """[layers, E] routing probabilities (None: balanced)."""
        if self.kind == "balanced":
            return None
        if self.kind == "zipf":
            p = 1.0 / np.arange(1, num_experts + 1) ** self.exponent
            perm = np.argsort(rng.random((layers, num_experts)), axis=1)
            return (p / p.sum())[perm]
        a = np.asarray(self.load, float)
        if a.shape[-1] != num_experts or (a.ndim == 2 and a.shape[0] != layers):
            raise ConfigError(f"routing.load shape {a.shape}: need [{num_experts}] or "
                              f"[{layers}, {num_experts}]")
        a = np.broadcast_to(a, (layers, num_experts))
        return a / a.sum(axis=1, keepdims=True)


def draw_counts(probs: np.ndarray | None, tokens: np.ndarray, top_k: int, num_experts: int,
                layers: int, rng: np.random.Generator) -> np.ndarray:
    """Token counts per expert [layers, len(tokens), E] for micro-batches of ``tokens`` tokens."""
    tokens = np.asarray(tokens, float)
    if probs is None:
        return np.broadcast_to((tokens * top_k / num_experts)[None, :, None],
                               (layers, len(tokens), num_experts))
    slots = np.rint(tokens * top_k).astype(np.int64)
    return np.stack([rng.multinomial(slots, probs[l]) for l in range(layers)]).astype(float)


def makespan(starts: np.ndarray, sizes: np.ndarray, rate: np.ndarray) -> np.ndarray:
    """When a work-conserving link (bytes/s ``rate``) has delivered all of its messages.

    ``starts``, ``sizes``: [..., n] messages that become ready at ``starts`` on one link per row;
    the answer max_k (t_k + sum of sizes ready at or after t_k) / rate is the same for FIFO and
    fair sharing. Equal starts: t + total / rate.
    """
    o = np.argsort(starts, axis=-1, kind="stable")
    t = np.take_along_axis(starts, o, axis=-1)
    s = np.take_along_axis(sizes, o, axis=-1)
    suffix = np.cumsum(s[..., ::-1], axis=-1)[..., ::-1]
    return (t + suffix / np.asarray(rate)[..., None]).max(axis=-1)


def makespan_outer(starts: np.ndarray, weights: np.ndarray, free: np.ndarray,
                   per_weight_s: np.ndarray) -> np.ndarray:
    """``makespan`` for the all-to-all case: K senders each send every receiver j one message,
    ready at ``max(starts[k], free[j])`` (receiver j's link is busy until ``free[j]``), of
    ``weights[k]`` units taking ``per_weight_s[j]`` seconds each on j's link. Returns [J].
    max(starts, free) keeps the senders' order, so one sort of ``starts`` serves every row."""
    o = np.argsort(starts, kind="stable")
    ts = starts[o]
    suffix = np.cumsum(weights[o][::-1])[::-1]
    if ts[0] == ts[-1]:  # all senders at once (the common, lock-step case)
        return np.maximum(ts[0], free) + per_weight_s * suffix[0]
    return (np.maximum(ts[None, :], free[:, None]) + per_weight_s[:, None] * suffix[None, :]).max(axis=1)


def fair_share(starts, sizes, bandwidth: float, latency: float = 0.0) -> np.ndarray:
    """Each message's finish on one link of ``bandwidth`` bytes/s shared equally by the messages
    in flight (processor sharing), plus ``latency``. Exact event loop over arrivals/departures."""
    starts, sizes = np.asarray(starts, float), np.asarray(sizes, float)
    left = sizes.copy()
    n = len(starts)
    done = np.full(n, np.nan)
    order = list(np.argsort(starts, kind="stable"))
    active: list[int] = []
    t = starts[order[0]] if n else 0.0
    while order or active:
        while order and starts[order[0]] <= t:
            active.append(order.pop(0))
        if not active:
            t = starts[order[0]]
            continue
        rate = bandwidth / len(active)
        t_fin = t + min(left[i] for i in active) / rate
        t_next = starts[order[0]] if order else math.inf
        t_new = min(t_fin, t_next)
        for i in active:
            left[i] -= (t_new - t) * rate
        t = t_new
        for i in [i for i in active if left[i] <= 1e-12 * max(1.0, sizes[i])]:
            active.remove(i)
            done[i] = t + latency
    return done
