"""The live planner's loop: each interval the served window's measurements in (``ServedWindow``),
a short-horizon forecast of the load (``LoadForecast``), the simulator's predictions of every
role assignment of the same N ranks corrected by measured/predicted TTFT and TPOT of the one
serving now (``Corrections``, NVIDIA Dynamo's SLA planner's factors), and one ``Decision``: stay,
hold (hysteresis) or switch. A switch needs a gain over the horizon larger than ``min_gain``
after the switch's own cost (nothing served while it runs), the same winner in ``confirm``
intervals running and ``dwell_s`` since the last switch. Pure arithmetic: the evaluator
(``live_candidates.SimulatedAssignments``) runs the simulations. docs/replan.md, "The live
planner"."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class ServedWindow:
    """One interval of served traffic, as the server's metrics give it."""

    end_s: float  # the window's end, seconds on the planner's clock
    duration_s: float
    arrivals: int  # requests that arrived in it
    mean_prompt_len: float  # of those requests (0: none arrived)
    mean_output_len: float
    ttft_p_s: Optional[float] = None  # measured SLO percentile of the requests that finished
    tpot_p_s: Optional[float] = None  # (None: none finished)
    waiting: int = 0  # queue depth at its end (logged)

    def __post_init__(self):
        if not self.duration_s > 0:
            raise ValueError(f"ServedWindow.duration_s={self.duration_s!r}: must be > 0")
        if self.arrivals < 0:
            raise ValueError(f"ServedWindow.arrivals={self.arrivals!r}: must be >= 0")


@dataclass(frozen=True)
class Load:
    rate: float  # requests / s
    prompt_len: float
    output_len: float


class LoadForecast:
    """Holt's linear smoothing of the arrival rate (level ``alpha``, trend ``beta``), the
    lengths smoothed by ``alpha`` (windows without arrivals keep them); ``predict(h)``: the load
    ``h`` seconds past the last window (the rate never below 0)."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3):
        for name, v in (("alpha", alpha), ("beta", beta)):
            if not 0 < v <= 1:
                raise ValueError(f"LoadForecast.{name}={v!r}: must be in (0, 1]")
        self.alpha, self.beta = alpha, beta
        self.level: Optional[float] = None
        self.trend = 0.0  # requests / s per second
        self.prompt_len = self.output_len = 0.0
        self.last_duration = 1.0

    def observe(self, w: ServedWindow) -> None:
        rate = w.arrivals / w.duration_s
        if self.level is None:
            self.level = rate
        else:
            prev = self.level
            self.level = self.alpha * rate + (1 - self.alpha) * (prev + self.trend * w.duration_s)
            self.trend = self.beta * (self.level - prev) / w.duration_s + \
                (1 - self.beta) * self.trend
        if w.arrivals:
            a = self.alpha if self.prompt_len else 1.0
            self.prompt_len += a * (w.mean_prompt_len - self.prompt_len)
            self.output_len += a * (w.mean_output_len - self.output_len)
        self.last_duration = w.duration_s

    def predict(self, horizon_s: float) -> Load:
        if self.level is None:
            raise ValueError("LoadForecast.predict: no window observed yet")
        return Load(max(0.0, self.level + self.trend * horizon_s), self.prompt_len,
                    self.output_len)


@dataclass
class Corrections:
    """measured / predicted TTFT and TPOT of the assignment serving now, smoothed by ``alpha``
    and kept within [1 / ``bound``, ``bound``]; every candidate's prediction is scaled by them."""

    ttft: float = 1.0
    tpot: float = 1.0
    alpha: float = 0.5
    bound: float = 5.0

    def observe(self, measured: Optional[float], predicted: Optional[float], which: str) -> None:
        if not measured or not predicted or not math.isfinite(predicted) or predicted <= 0:
            return
        ratio = min(self.bound, max(1 / self.bound, measured / predicted))
        setattr(self, which, getattr(self, which) + self.alpha * (ratio - getattr(self, which)))


@dataclass(frozen=True)
class Prediction:
    """One assignment at a load: its SLO percentiles and goodput, corrections applied."""

    assignment: str  # its label, e.g. ``a1e2m2`` or ``p1+a1e1m2``
    ttft_p_s: float
    tpot_p_s: float
    goodput_req_s: float
    headroom: float = 0.0  # the SLO percentile over its bound, the tighter of the two
    deploy: dict = field(default_factory=dict, compare=False)  # the deploy.* counts it sets


# (load, corrections, the current assignment, it alone?) -> predictions, the current among them
Evaluator = Callable[[Load, Corrections, str, bool], Sequence[Prediction]]


@dataclass(frozen=True)
class Decision:
    at_s: float
    action: str  # stay | hold | switch
    current: str
    target: str  # the assignment to run next (== current unless switching)
    reason: str
    load: Load  # the forecast the candidates were judged at
    corrections: tuple  # (ttft, tpot)
    predicted: dict  # assignment -> predicted goodput, req/s


TIE = 0.01  # goodputs within this fraction of the best are equal: the most SLO headroom wins


class LivePlanner:
    """``decide(window)`` once per interval; ``log``: every decision, oldest first. The
    predicted best: the most goodput (within ``TIE``), then the most SLO headroom."""

    def __init__(self, evaluate: Evaluator, current: str, horizon_s: float = 60.0,
                 switch_s: float = 1.0, min_gain: float = 0.10, dwell_s: float = 60.0,
                 confirm: int = 2, forecast: Optional[LoadForecast] = None):
        if not horizon_s > switch_s >= 0:
            raise ValueError(f"LivePlanner: horizon_s={horizon_s} must exceed switch_s="
                             f"{switch_s} >= 0")
        if confirm < 1:
            raise ValueError(f"LivePlanner.confirm={confirm!r}: must be >= 1")
        self.evaluate, self.current = evaluate, current
        self.horizon_s, self.switch_s, self.min_gain = horizon_s, switch_s, min_gain
        self.dwell_s, self.confirm = dwell_s, confirm
        self.forecast = forecast or LoadForecast()
        self.corrections = Corrections()
        self.last_switch_s = -math.inf
        self.streak: tuple[str, int] = ("", 0)  # the winner of the last intervals, how many
        self.log: list[Decision] = []

    def decide(self, w: ServedWindow) -> Decision:
        self._correct(w)
        self.forecast.observe(w)
        load = self.forecast.predict(self.horizon_s / 2)  # the horizon's middle
        preds = {p.assignment: p for p in self.evaluate(load, self.corrections, self.current,
                                                        False)}
        cur = preds.get(self.current)
        best = self._best(list(preds.values()))
        g_cur = cur.goodput_req_s if cur is not None else 0.0
        if best is None or best.assignment == self.current:
            self.streak = ("", 0)
            return self._record(w, "stay", self.current, "the current assignment is predicted "
                                f"best ({g_cur:.3g} req/s)", load, preds)
        horizon, cost = self.horizon_s, self.switch_s
        after = best.goodput_req_s * (horizon - cost)
        stay = g_cur * horizon
        need = stay * (1 + self.min_gain) if stay > 0 else 0.0
        numbers = (f"{best.assignment} {best.goodput_req_s:.3g} req/s vs {self.current} "
                   f"{g_cur:.3g}: over {horizon:g} s after a {cost:g} s switch "
                   f"{after:.3g} requests vs {stay:.3g}")
        if after <= need:
            self.streak = ("", 0)
            return self._record(w, "stay", self.current, f"gain below min_gain={self.min_gain:g}"
                                f" after the switch's cost: {numbers}", load, preds)
        name, n = self.streak
        self.streak = (best.assignment, n + 1 if name == best.assignment else 1)
        since = w.end_s - self.last_switch_s
        if since < self.dwell_s:
            return self._record(w, "hold", self.current, f"{since:.3g} s since the last switch "
                                f"< dwell_s={self.dwell_s:g}: {numbers}", load, preds)
        if self.streak[1] < self.confirm:
            return self._record(w, "hold", self.current, f"winner {self.streak[1]} of "
                                f"confirm={self.confirm} intervals: {numbers}", load, preds)
        self.last_switch_s, self.streak = w.end_s, ("", 0)
        old, self.current = self.current, best.assignment
        return self._record(w, "switch", best.assignment, f"{numbers}", load, preds, old)

    def _best(self, preds: list) -> Optional[Prediction]:
        if not preds:
            return None
        top = max(p.goodput_req_s for p in preds)
        near = [p for p in preds if p.goodput_req_s >= top * (1 - TIE)]
        return min(near, key=lambda p: (p.headroom, p.assignment != self.current,
                                        p.assignment))

    def _correct(self, w: ServedWindow) -> None:
        """The current assignment's prediction at the window's own load against what it
        measured."""
        if w.ttft_p_s is None and w.tpot_p_s is None or not w.arrivals:
            return
        seen = Load(w.arrivals / w.duration_s, w.mean_prompt_len, w.mean_output_len)
        got = list(self.evaluate(seen, Corrections(), self.current, True))
        if got:
            self.corrections.observe(w.ttft_p_s, got[0].ttft_p_s, "ttft")
            self.corrections.observe(w.tpot_p_s, got[0].tpot_p_s, "tpot")

    def _record(self, w, action, target, reason, load, preds, current=None) -> Decision:
        d = Decision(w.end_s, action, current or self.current, target, reason, load,
                     (self.corrections.ttft, self.corrections.tpot),
                     {k: p.goodput_req_s for k, p in preds.items()})
        self.log.append(d)
        return d
