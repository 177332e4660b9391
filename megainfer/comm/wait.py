"""How a rank waits for a request: spin, yield, or poll with a growing sleep.

When ranks outnumber cores (the default job: 3 ranks on 2 cores) a spinning wait takes a
core another rank needs. ``backoff`` (the default) polls for ``spin_s``, then sleeps
``min_sleep_s`` doubling up to ``max_sleep_s`` between polls; ``yield`` calls
``sched_yield`` between polls; ``spin`` polls flat out (lowest latency on idle cores).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from megainfer.config import ConfigError

WAIT_MODES = ("spin", "yield", "backoff")


@dataclass(frozen=True)
class WaitPolicy:
    mode: str = "backoff"
    spin_s: float = 50e-6      # poll flat out this long before sleeping (backoff only)
    min_sleep_s: float = 10e-6
    max_sleep_s: float = 1e-3
    timeout_s: float = 60.0    # a wait longer than this raises CommTimeoutError

    def __post_init__(self):
        if self.mode not in WAIT_MODES:
            raise ConfigError(f"wait.mode={self.mode!r}: must be one of {WAIT_MODES}")
        for name in ("spin_s", "min_sleep_s", "max_sleep_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"wait.{name}={getattr(self, name)!r}: must be >= 0")
        if self.max_sleep_s < self.min_sleep_s:
            raise ConfigError(f"wait.max_sleep_s={self.max_sleep_s!r}: must be >= min_sleep_s")
        if not self.timeout_s > 0:
            raise ConfigError(f"wait.timeout_s={self.timeout_s!r}: must be > 0")


def wait_until(test: Callable[[], bool], policy: WaitPolicy) -> float:
    """Poll ``test`` until it is true; return seconds waited, or -seconds on timeout."""
    if test():
        return 0.0
    t0 = time.perf_counter()
    deadline = t0 + policy.timeout_s
    spin_end = t0 + (policy.spin_s if policy.mode == "backoff" else policy.timeout_s)
    sleep_s = policy.min_sleep_s
    n = 0
    while True:
        if test():
            return time.perf_counter() - t0
        n += 1
        if n & 15 == 0 or policy.mode == "backoff":  # check the clock every 16 polls when spinning
            now = time.perf_counter()
            if now > deadline:
                return -(now - t0)
            if policy.mode == "backoff" and now > spin_end:
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, policy.max_sleep_s)
        if policy.mode == "yield":
            os.sched_yield()
