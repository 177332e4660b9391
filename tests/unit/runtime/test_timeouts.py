"""The ladder of waits (``runtime/timeouts.py``): each rank's wait, the hang bound and the idle
iteration from ``comm.timeout_s``, in the order that names the silent rank first."""
from megainfer.runtime import timeouts as T


def test_the_ladder_names_the_silent_rank_first():
    t = 8.0
    assert T.rank_wait_s(t, "attention") < T.core_hang_s(t) < T.rank_wait_s(t, "expert")
    assert T.rank_wait_s(t, "prefill") == t and T.switch_wait_s(t) == 2 * t
    assert T.idle_interval_s(t) == 0.5 and T.idle_interval_s(2.0) == 0.25
    assert T.pd_idle_wait_s(t) == 0.5 and T.pd_idle_wait_s(1.0) == 0.25
    assert T.idle_interval_s(t) < T.rank_wait_s(t, "attention")
