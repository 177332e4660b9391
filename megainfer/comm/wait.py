"""How a rank waits for a request: spin, yield, or backoff (spin, then yield, then sleep).

When ranks outnumber cores (the default job: 3 ranks on 2 cores) a spinning wait takes a core
another rank needs. ``backoff`` (the default): spin ``spin_s`` (small-message latency); then
``sched_yield`` between polls for ``yield_s`` (a peer waiting for this core gets it at once);
then sleep ``min_sleep_s`` doubling to ``max_sleep_s``, never more than ``sleep_frac`` of the
time waited so far nor past the timeout; past ``idle_after_s`` a wait is idle and its sleeps
grow to ``idle_sleep_s``. Before its first sleep a thread sets its timer slack to
``TIMER_SLACK_NS`` (Linux rounds sleeps up by 50 us by default). ``yield`` yields between polls
for the whole wait; ``spin`` polls flat out. docs/comm.md, "Waiting"."""
from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from megainfer.config import ConfigError

WAIT_MODES = ("spin", "yield", "backoff")
CLOCK_EVERY = 16         # polls between clock reads while spinning or yielding
TIMER_SLACK_NS = 1000    # prctl(PR_SET_TIMERSLACK) for threads that sleep in a wait
PR_SET_TIMERSLACK = 29


@dataclass(frozen=True)
class WaitPolicy:
    mode: str = "backoff"
    spin_s: float = 0.0        # backoff: poll flat out this long,
    yield_s: float = 300e-6    # then poll with sched_yield this long, then sleep
    min_sleep_s: float = 10e-6
    max_sleep_s: float = 1e-3
    idle_after_s: float = 0.1  # a wait this long is idle: its sleeps may grow
    idle_sleep_s: float = 5e-3  # to this (or max_sleep_s, whichever is longer)
    sleep_frac: float = 0.125  # a sleep is at most this fraction of the time waited so far
    timeout_s: float = 60.0    # a wait longer than this raises CommTimeoutError

    def __post_init__(self):
        if self.mode not in WAIT_MODES:
            raise ConfigError(f"wait.mode={self.mode!r}: must be one of {WAIT_MODES}")
        for name in ("spin_s", "yield_s", "min_sleep_s", "max_sleep_s", "idle_after_s",
                     "idle_sleep_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"wait.{name}={getattr(self, name)!r}: must be >= 0")
        if self.max_sleep_s < self.min_sleep_s:
            raise ConfigError(f"wait.max_sleep_s={self.max_sleep_s!r}: must be >= min_sleep_s")
        if not 0 < self.sleep_frac <= 1:
            raise ConfigError(f"wait.sleep_frac={self.sleep_frac!r}: must be in (0, 1]")
        if not self.timeout_s > 0:
            raise ConfigError(f"wait.timeout_s={self.timeout_s!r}: must be > 0")


_slack = threading.local()


def _tighten_timer_slack() -> None:
    """Once per thread: sleeps of tens of microseconds last about that long (Linux only)."""
    if getattr(_slack, "done", False):
        return
    _slack.done = True
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: sleeps are just coarser
        pass


def _poll(test: Callable[[], bool], t0: float, until: float, yielder) -> float:
    """Poll until ``test()`` (return the time waited) or the clock passes ``until`` (-now);
    with a ``yielder``, yield before each poll."""
    clock = time.perf_counter
    while True:
        for _ in range(CLOCK_EVERY):
            if yielder is not None:
                yielder()
            if test():
                return clock() - t0
        now = clock()
        if now > until:
            return -now


def wait_until(test: Callable[[], bool], policy: WaitPolicy) -> float:
    """Poll ``test`` until it is true; return seconds waited, or -seconds on timeout.

    A yielding policy yields before every poll, the first one too: the channel comes here when
    ``test()`` just failed, and a poll straight after it finds nothing new while its MPI
    progress call delays the rank that shares our core and owes us the message (measured:
    docs/comm.md, "Findings")."""
    clock = time.perf_counter
    t0 = clock()
    mode, deadline = policy.mode, t0 + policy.timeout_s
    if mode != "backoff":
        got = _poll(test, t0, deadline, os.sched_yield if mode == "yield" else None)
        return got if got >= 0 else -(-got - t0)
    got = _poll(test, t0, min(t0 + policy.spin_s, deadline), None) if policy.spin_s else -t0
    if got < 0:
        got = _poll(test, t0, min(t0 + policy.spin_s + policy.yield_s, deadline),
                    os.sched_yield)
    if got >= 0:
        return got
    now = -got
    _tighten_timer_slack()
    sleep_s, frac, cap = policy.min_sleep_s, policy.sleep_frac, policy.max_sleep_s
    idle_at, idle_cap = t0 + policy.idle_after_s, max(cap, policy.idle_sleep_s)
    while now <= deadline:
        time.sleep(min(sleep_s, frac * (now - t0), deadline - now))  # no later than the deadline
        if test():
            return clock() - t0
        now = clock()
        sleep_s = min(sleep_s * 2, cap if now < idle_at else idle_cap)
    return -(now - t0)
