"""Which recorded PD runs the validation counts as quiet, and how far a simulated figure lies
outside its launches' range (megainfer/bench/pd_runs.py, used by perf/validate/validate_sim_pd.py)."""
import pytest

from megainfer.bench import pd_runs as pr


def _run(loads, date="2026-12-01T03:04:40+00:00", probed=True, ranks=4):
    return {"date": date, "args": {"ranks": ranks}, "calibrations": [{}] if probed else [],
            "rows": [{"load_average": x} for x in loads]}


def test_quiet_needs_probes_the_sleeping_pool_and_no_other_tenants():
    assert pr.is_quiet(_run([2.3, 2.5, 3.3]))
    assert not pr.is_quiet(_run([2.3, 4.2]))  # one launch above the job's own 4 ranks
    assert not pr.is_quiet(_run([2.3, None]))  # a launch with no load recorded
    assert not pr.is_quiet(_run([2.3], probed=False))
    assert not pr.is_quiet(_run([2.3], date="2026-12-01T00:44:38+00:00"))  # before IDLE_FIX
    assert pr.others_ran(_run([4.5])) and not pr.others_ran(_run([4.0]))


def test_beyond_is_zero_inside_the_launch_range_and_relative_to_the_nearer_end():
    assert pr.beyond(100.0, 90.0, 110.0) == 0.0
    assert pr.beyond(90.0, 90.0, 110.0) == 0.0
    assert pr.beyond(121.0, 90.0, 110.0) == pytest.approx(0.1)
    assert pr.beyond(81.0, 90.0, 110.0) == pytest.approx(-0.1)


def test_stats_goal():
    assert pr.stats([0.05, -0.19, 0.02])["goal_met"]
    assert not pr.stats([0.05, -0.21, 0.02])["goal_met"]
    assert not pr.stats([0.15, -0.15, 0.02])["goal_met"]  # median 15 %


def test_conditions_read_a_probe_slowdown_as_load_or_as_speed():
    """``load``: one busy probe rank beside B others on 2 cores is slowed (1 + B) / 2, so a
    probe at the reference speed already implies B = 1 (the quiet-machine bias ``auto`` avoids);
    ``scale``: the slowdown scales the layer times, no background load."""
    probe = {"prefill": 1.1, "decode": 1.2}
    load = pr.conditions(probe, probe, 2, "load")
    assert load["background_load"] == pytest.approx(1.2) and load["speed"] == 1.0
    scale = pr.conditions(probe, probe, 2, "scale")
    assert scale["background_load"] == 0.0 and scale["speed"] == pytest.approx(1.1)


def test_host_terms_read_wake_up_and_iteration_overhead_off_calibration_runs():
    from megainfer.perfmodel.model.hardware import load_hardware
    hw = load_hardware("cpu_node")
    link = hw.inter_link.time(4 * pr.TOP_K * pr.HIDDEN * 4)  # a 4-token hop's message
    samples = [{"hops": [(4, link + 0.001), (4, link + 0.002), (4, link + 0.003)],
                "step_gaps": [(4, 0.006), (4, 0.007)]}]
    got = pr.host_terms(samples, hw)
    assert got["wake_latency_s"] == pytest.approx(0.002)
    assert got["iteration_overhead_s"] == pytest.approx(0.0065 - 0.002)
    assert pr.host_terms([{"decode_attention": []}], hw) is None  # runs that kept no hops
