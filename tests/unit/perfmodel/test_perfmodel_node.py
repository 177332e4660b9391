"""Node sharing terms: ranks on one CPU node share cores and memory, pay host work per hop and
a wake-up latency; datasheet GPU profiles (one device per rank) are unaffected."""
import dataclasses

import pytest

from megainfer.config import ConfigError
from megainfer.calibration import node_bench
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
from megainfer.perfmodel.model.hardware import NodeProfile, known_hardware, load_hardware, profile_from_dict
from megainfer.perfmodel.model.layer_times import RooflineTimes, layer_times_for
from megainfer.perfmodel.model.pipeline import t_total
from megainfer.perfmodel.sim.fixed_batch import simulate_plan
from perfmodel_helpers import TINY, synthetic_hw

NODE = NodeProfile(cores=2, contention={"attention": 1.1, "expert": 1.2},
                   hop_overhead_s={"attention": {"base": 1e-4, "per_peer": 2e-5},
                                   "expert": {"base": 3e-5, "per_peer": 1e-5}},
                   wake_latency_s=5e-4)


def test_dilation_hand_computed():
    assert NODE.dilation("attention", 1) == 1.0
    assert NODE.dilation("attention", 2) == pytest.approx(1.1)  # two cores, both busy: contention
    assert NODE.dilation("expert", 3) == pytest.approx(1.5 * 1.2)  # 3 ranks time-share 2 cores
    assert NODE.dilation("expert", 1.5) == pytest.approx(1.1)  # half the time a second one runs
    assert NodeProfile().dilation("attention", 8) == 1.0  # cores=0: one device per rank
    assert NODE.hop_overhead("attention", 3) == pytest.approx(1e-4 + 3 * 2e-5)
    assert NODE.hop_overhead("expert", 2) == pytest.approx(3e-5 + 2e-5)


def test_bad_node_section_names_the_field():
    base = {"name": "x", "matmul_flops": {"float32": 1e9}, "mem_bw_Bps": 1e9, "mem_bytes": 1e9,
            "price_per_hour": 0, "inter_link": {"latency_s": 1e-6, "bandwidth_Bps": 1e9}}
    for node, field in (({"cores": -1}, "node.cores"), ({"contention": {"attention": 0.5}}, "node.contention"),
                        ({"contention": {"router": 1.1}}, "node.contention"),
                        ({"hop_overhead_s": {"expert": {"base": -1.0}}}, "node.hop_overhead_s"),
                        ({"wake_latency_s": -1e-3}, "node.wake_latency_s"), ({"gpus": 1}, "unknown keys")):
        with pytest.raises(ConfigError, match=field):
            profile_from_dict({**base, "node": node})
    with pytest.raises(ConfigError, match="plan.ranks_per_node"):
        Plan(1, 1, 1, 1, 1, 8, ranks_per_node=-1)
    hw = profile_from_dict({**base, "node": {"cores": 4, "contention": {"expert": 1.3},
                                             "hop_overhead_s": {"attention": {"base": 1e-4}}}})
    assert hw.node.cores == 4 and hw.node.contention == {"expert": 1.3}


def _model(node, workload=Workload(64, 32)):
    hw = dataclasses.replace(synthetic_hw(), node=node)
    t = RooflineTimes(hw, TINY)
    return DisaggModel(TINY, t, t, workload), t


def test_node_terms_hand_computed():
    model, t = _model(NODE)
    ctx = model.wl.ctx_mean
    # m=1, A2:E1 on 2 cores: both replicas compute together (2 busy), the expert alone
    plan = Plan(1, 2, 1, 1, 1, 32)
    ta0, te0 = t.t_attn(16, ctx), t.t_expert([8] * 8)
    h_a, h_e, d_a, d_e = model.node_terms(plan, ta0, te0)
    assert (h_a, h_e) == pytest.approx((1e-4 + 2e-5, 3e-5 + 2 * 1e-5))
    assert (d_a, d_e) == pytest.approx((1.1, 1.0))
    pred = model.predict(plan)
    assert pred.t_a == pytest.approx((ta0 + h_a) * 1.1) and pred.t_e == pytest.approx(te0 + h_e)
    bare, _ = _model(NodeProfile())
    assert pred.t_c == pytest.approx(bare.predict(plan).t_c + 5e-4)
    assert pred.t_total == pytest.approx(t_total(pred.t_a, pred.t_e, pred.t_c, 1, TINY.num_layers))
    # m=2: attention of one micro-batch overlaps the experts of the other for phi of its time
    plan = Plan(1, 2, 1, 1, 2, 32)
    ta0, te0 = t.t_attn(8, ctx), t.t_expert([4] * 8)
    _, _, d_a, d_e = model.node_terms(plan, ta0, te0)
    ta, te = ta0 + h_a, te0 + h_e
    phi_a, phi_e = min(1, te / ta), min(1, ta / te)
    assert d_a == pytest.approx((1 - phi_a) * 1.1 + phi_a * 1.5 * 1.1)
    assert d_e == pytest.approx((1 - phi_e) * 1.0 + phi_e * 1.5 * 1.2)
    # ranks spread over nodes of 1 rank each: no sharing left
    _, _, d_a, d_e = model.node_terms(dataclasses.replace(plan, ranks_per_node=1), ta0, te0)
    assert d_a == pytest.approx(1.0) and d_e == pytest.approx(1.0)


def test_node_terms_only_slow_it_down_and_sim_equals_t_total():
    model, _ = _model(NODE)
    bare, _ = _model(NodeProfile())
    for plan in (Plan(1, 2, 1, 1, 2, 32), Plan(1, 1, 1, 2, 3, 24), Plan(2, 1, 1, 4, 1, 16)):
        pred = model.predict(plan)
        assert pred.t_iter > bare.predict(plan).t_iter
        res = simulate_plan(model, plan, iterations=2)  # zero jitter, balanced load
        assert res.iteration_s == pytest.approx([pred.t_total] * 2, rel=1e-12)


@pytest.mark.parametrize("name", [n for n in known_hardware() if n != "cpu_node"])
def test_datasheet_profiles_have_no_node_sharing(name):
    hw = load_hardware(name)
    assert not hw.node.shared and hw.node.wake_latency_s == 0 and not hw.node.hop_overhead_s
    t = layer_times_for(hw, TINY, "bfloat16", use_fit=False)
    model = DisaggModel(TINY, t, t, Workload(64, 32))
    plan = Plan(1, 3, 1, 2, 2, 60)
    pred = model.predict(plan)
    assert pred.t_a == t.t_attn(10, 80, 1) and pred.t_e == t.t_expert([7.5] * 4)  # b_e = B K / (m E)


def test_shipped_cpu_profile_describes_its_node():
    node = load_hardware("cpu_node").node
    assert node.cores >= 1 and set(node.contention) == {"attention", "expert"}
    assert all(1.0 <= v < 3 for v in node.contention.values())
    assert 0 < node.hop_overhead("attention", 1) < 0.01 and 0 <= node.wake_latency_s < 0.01


def test_node_bench_measures_something():
    hop = node_bench.hop_overhead(TINY, b=4, hops=20)
    for side in ("attention", "expert"):
        assert hop[side]["base"] >= 0 and hop[side]["per_peer"] >= 0
        assert 0 < hop[side]["base"] + hop[side]["per_peer"] < 0.05
    wake = node_bench.wake_latency(wait_s=0.002, trials=4)
    assert 0 <= wake["mean_s"] < 0.05 and wake["mode"] == "backoff"
    c = node_bench.contention_slowdown(TINY, "expert", b=2, experts=2, rounds=1, min_s=0.01)
    assert c["slowdown"] >= 1.0 and c["alone_s"] > 0 and len(c["ratios"]) == 1


def test_colocated_baseline_gets_the_same_node_terms():
    from megainfer.perfmodel.model.colocated import ColocatedModel, ColocatedPlan
    hw = dataclasses.replace(synthetic_hw(), node=NODE)
    shared = ColocatedModel(TINY, RooflineTimes(hw, TINY), Workload(64, 32))
    bare = ColocatedModel(TINY, RooflineTimes(synthetic_hw(), TINY), Workload(64, 32))
    plan = ColocatedPlan(4, 1, 16)
    assert shared.predict(plan).t_iter > bare.predict(plan).t_iter
    t = RooflineTimes(synthetic_hw(), TINY)
    t_a = (t.t_attn(16, 80, 4) + 1e-4 + 4 * 2e-5) * 2.0 * 1.1  # 4 ranks time-share 2 cores, contention
    t_e = (t.t_expert([4.0] * 2) + 3e-5 + 4 * 1e-5) * 2.0 * 1.2
    t_x = hw.intra_link.time(16 * 2 * 64 * 2 / 4, n_msgs=3) + 5e-4
    assert shared.predict(plan).t_layer == pytest.approx(t_a + t_e + 2 * t_x)


def test_merge_keeps_other_fits_and_node_only_keeps_the_rest(tmp_path):
    import yaml
    from megainfer.calibration.calibrate import merge_profile, remeasure_node, write_profile
    path = str(tmp_path / "cpu.yaml")
    old = {"name": "cpu", "matmul_flops": {"float32": 1e9}, "mem_bw_Bps": 1e9, "mem_bytes": 1e9,
           "price_per_hour": 0.1, "inter_link": {"latency_s": 1e-6, "bandwidth_Bps": 1e9},
           "fits": {"other": {"k1": 1.0, "k2": 2.0, "k3": 3.0, "k4": 4.0}},
           "calibration_notes": ["node: old", "fits.other: kept"]}
    write_profile(old, path)
    new = {**old, "fits": {"tiny": {"k1": 5.0, "k2": 6.0, "k3": 7.0, "k4": 8.0}}}
    del new["calibration_notes"]
    merged = merge_profile(new, path)
    assert set(merged["fits"]) == {"other", "tiny"} and merged["fits"]["tiny"]["k1"] == 5.0
    with pytest.raises(ConfigError, match="calibrate.out"):
        remeasure_node(str(tmp_path / "missing.yaml"), TINY, smoke=True)
    prof = remeasure_node(path, TINY, smoke=True)
    write_profile(prof, path)
    hw = load_hardware(path)
    assert hw.node.shared and hw.fits["other"].k4 == 4.0 and hw.matmul_flops["float32"] == 1e9
    notes = yaml.safe_load(open(path))["calibration_notes"]
    assert "fits.other: kept" in notes and "node: old" not in notes and notes[-1].startswith("node:")


def test_a_tp_group_waits_for_its_all_reduce_on_a_shared_node():
    """TP > 1 on a CPU node: one all-reduce per (layer, micro-batch), noticed wake_latency_s
    late, added to the stage time unstretched; TP 1 and GPU profiles (cores 0) pay nothing."""
    def model(node):
        hw = dataclasses.replace(synthetic_hw(mem=4e7), node=node)
        t = layer_times_for(hw, TINY, "bfloat16", False)
        return DisaggModel(TINY, t, t, Workload(64, 16))
    woke, still = model(NODE), model(dataclasses.replace(NODE, wake_latency_s=0.0))
    w = NODE.wake_latency_s
    for plan, extra_a, extra_e in ((Plan(1, 2, 1, 2, 2, 16), 0, 0), (Plan(2, 1, 1, 2, 2, 16), w, 0),
                                   (Plan(1, 2, 2, 1, 2, 16), 0, w), (Plan(2, 1, 2, 1, 1, 16), w, w)):
        h_a, h_e, d_a, d_e = woke.node_terms(plan, 1e-3, 2e-3)
        g_a, g_e, c_a, c_e = still.node_terms(plan, 1e-3, 2e-3)
        assert (d_a, d_e) == (c_a, c_e)  # the wait does not change who computes at once
        assert (1e-3 + h_a) * d_a - (1e-3 + g_a) * c_a == pytest.approx(extra_a)
        assert (2e-3 + h_e) * d_e - (2e-3 + g_e) * c_e == pytest.approx(extra_e)
    gpu = DisaggModel(TINY, *(2 * [layer_times_for(synthetic_hw(mem=4e7), TINY, "bfloat16", False)]),
                      Workload(64, 16))
    assert gpu.node_terms(Plan(2, 1, 2, 1, 2, 16), 1e-3, 1e-3) == (0.0, 0.0, 1.0, 1.0)
