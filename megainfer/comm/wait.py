"""How a rank waits for a request: spin, yield, or poll with a growing sleep.

When ranks outnumber cores (the default job: 3 ranks on 2 cores) a spinning wait takes a
core another rank needs. ``backoff`` (the default) polls flat out for ``spin_s`` (so a
message that comes soon is seen as fast as ``spin`` would see it), then sleeps between
polls: ``min_sleep_s`` doubling up to ``max_sleep_s``, and never more than ``sleep_frac``
of the time waited so far, so a long transfer (an 8 MB message) is noticed at most that
fraction late while a long idle wait still costs few wake-ups. ``yield`` calls
``sched_yield`` between polls; ``spin`` polls flat out (lowest latency on idle cores).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from megainfer.config import ConfigError

WAIT_MODES = ("spin", "yield", "backoff")
CLOCK_EVERY = 16  # polls between clock reads while spinning


@dataclass(frozen=True)
class WaitPolicy:
    mode: str = "backoff"
    spin_s: float = 50e-6      # poll flat out this long before sleeping (backoff only)
    min_sleep_s: float = 10e-6
    max_sleep_s: float = 1e-3
    sleep_frac: float = 0.125  # a sleep is at most this fraction of the time waited so far
    timeout_s: float = 60.0    # a wait longer than this raises CommTimeoutError

    def __post_init__(self):
        if self.mode not in WAIT_MODES:
            raise ConfigError(f"wait.mode={self.mode!r}: must be one of {WAIT_MODES}")
        for name in ("spin_s", "min_sleep_s", "max_sleep_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"wait.{name}={getattr(self, name)!r}: must be >= 0")
        if self.max_sleep_s < self.min_sleep_s:
            raise ConfigError(f"wait.max_sleep_s={self.max_sleep_s!r}: must be >= min_sleep_s")
        if not 0 < self.sleep_frac <= 1:
            raise ConfigError(f"wait.sleep_frac={self.sleep_frac!r}: must be in (0, 1]")
        if not self.timeout_s > 0:
            raise ConfigError(f"wait.timeout_s={self.timeout_s!r}: must be > 0")


def wait_until(test: Callable[[], bool], policy: WaitPolicy) -> float:
    """Poll ``test`` until it is true; return seconds waited, or -seconds on timeout."""
    if test():
        return 0.0
    clock = time.perf_counter
    t0 = clock()
    mode = policy.mode
    deadline = t0 + policy.timeout_s
    spin_end = t0 + policy.spin_s if mode == "backoff" else deadline
    yielder = os.sched_yield if mode == "yield" else None
    while True:  # spin (or yield) phase: read the clock every CLOCK_EVERY polls
        for _ in range(CLOCK_EVERY):
            if test():
                return clock() - t0
            if yielder is not None:
                yielder()
        now = clock()
        if now > spin_end:
            break
    if now > deadline:
        return -(now - t0)
    sleep_s, frac, cap = policy.min_sleep_s, policy.sleep_frac, policy.max_sleep_s
    sleep = time.sleep
    while True:  # backoff: sleep, poll
        sleep(min(sleep_s, frac * (now - t0)))
        if test():
            return clock() - t0
        now = clock()
        if now > deadline:
            return -(now - t0)
        sleep_s = min(sleep_s * 2, cap)
