"""The ladder of waits of a distributed job, each a multiple of ``comm.timeout_s`` (T), in one
place; wiring, the switch, rank 0's online engine, PD's router and the engine core's hang
watch (``OnlineEngine.hang_after_s``) read it.

    rank 0 (attention, prefill) waits on a peer   1.0 T   a silent peer is named by rank 0
    rank 0's engine core is declared hung          1.5 T   before its peers' waits run out
    an expert rank / a re-plan's switch waits      2.0 T   (also an iteration's allowance)
    idle keep-alive iteration / PD report wait     min(0.5 s, T / 8) / min(0.5 s, T / 4)

Invariant: 1 < 1.5 < 2, so the right rank speaks first; checked when this module is imported.
docs/comm.md, "Timeouts"."""
from __future__ import annotations

PEER_WAIT = 1.0
CORE_HANG = 1.5
EXPERT_WAIT = 2.0
SWITCH_WAIT = 2.0
IDLE_TICKS_PER_TIMEOUT = 8  # idle iterations per T (at most 1 / IDLE_CAP_S a second)
PD_IDLE_WAITS_PER_TIMEOUT = 4
IDLE_CAP_S = 0.5

if not PEER_WAIT < CORE_HANG < EXPERT_WAIT:
    raise AssertionError("timeouts: rank 0's waits < its core's hang bound < the expert ranks' "
                         "waits, or the wrong rank is named when one goes silent")
if not 1.0 / IDLE_TICKS_PER_TIMEOUT < PEER_WAIT:
    raise AssertionError("timeouts: the idle iteration must come well within every rank's wait")


def rank_wait_s(timeout_s: float, role_kind: str) -> float:
    """How long a rank of ``role_kind`` waits on a peer before it names it."""
    return timeout_s * (EXPERT_WAIT if role_kind == "expert" else PEER_WAIT)


def core_hang_s(timeout_s: float) -> float:
    """How long the runtime's engine core may stay inside one round before it is hung."""
    return CORE_HANG * timeout_s


def switch_wait_s(timeout_s: float) -> float:
    """Each wait of a re-plan's switch of every rank (and its allowance beside an iteration)."""
    return SWITCH_WAIT * timeout_s


def idle_interval_s(timeout_s: float) -> float:
    """Rank 0's idle keep-alive iteration: every rank's watch on the others stays alive."""
    return min(IDLE_CAP_S, timeout_s / IDLE_TICKS_PER_TIMEOUT)


def pd_idle_wait_s(timeout_s: float) -> float:
    """PD rank 0's wait for a prefill report while nothing decodes (well under every wait)."""
    return min(IDLE_CAP_S, timeout_s / PD_IDLE_WAITS_PER_TIMEOUT)
