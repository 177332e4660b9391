"""The served traffic of one live-planner interval: ``ServedWindowRecorder`` is told of each
request that arrives (its prompt length) and each that finishes (``metrics.ServedRequest``: what
the frontend's ``RequestTimer`` measured, its output length, TTFT and TPOT), and ``take`` makes
the interval's ``ServedWindow`` (arrivals, their mean prompt length, the finished requests' mean
output length and TTFT / TPOT at the SLO percentile, the queue depth given) and starts the next.
On the event loop only. docs/replan.md, "The live planner"."""
from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np

from megainfer.perfmodel.plan.live_planner import ServedWindow

from .metrics import ServedRequest


def _percentile(values: list, q: float) -> Optional[float]:
    return float(np.percentile(values, q)) if values else None


class ServedWindowRecorder:
    """``percentile``: the SLO percentile (``slo.percentile``) the window's TTFT and TPOT are
    read at; ``clock``: seconds, monotonic (the planner's clock starts at 0 here)."""

    def __init__(self, percentile: float, clock: Callable[[], float] = time.monotonic):
        self.percentile, self.clock = percentile, clock
        self.origin = self.begin = clock()
        self.prompts: list[int] = []
        self.done: list[ServedRequest] = []
        self.output_len = 0.0  # the last window's with finished requests (arrivals need one)

    def arrived(self, prompt_len: int) -> None:
        self.prompts.append(prompt_len)

    def finished(self, req: ServedRequest) -> None:
        self.done.append(req)

    def take(self, waiting: int) -> ServedWindow:
        """The window since the last ``take`` (the recorder's start), ``waiting`` requests
        queued at its end; the next window starts now."""
        now = self.clock()
        prompts, done = self.prompts, self.done
        if done:
            self.output_len = sum(r.output_len for r in done) / len(done)
        w = ServedWindow(
            end_s=now - self.origin, duration_s=max(now - self.begin, 1e-6),
            arrivals=len(prompts),
            mean_prompt_len=sum(prompts) / len(prompts) if prompts else 0.0,
            mean_output_len=self.output_len if prompts else 0.0,
            ttft_p_s=_percentile([r.ttft_s for r in done if r.ttft_s is not None],
                                 self.percentile),
            tpot_p_s=_percentile([r.tpot_s for r in done if r.tpot_s is not None],
                                 self.percentile),
            waiting=waiting)
        self.begin, self.prompts, self.done = now, [], []
        return w
