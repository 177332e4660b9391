"""Calibration smoke test (tiny shapes, one round, real mpiexec ping-pong) and its pieces."""
import math

import pytest

from megainfer.config import ConfigError
from megainfer.calibration import layer_bench
from megainfer.calibration.calibrate import calibrate, fit_link, write_profile
from megainfer.perfmodel.model.hardware import load_hardware, profile_from_dict
from megainfer.perfmodel.model.layer_times import FittedTimes, layer_times_for
from megainfer.perfmodel.model.shapes import ModelShape
from perfmodel_helpers import TINY


def test_calibrate_smoke_writes_loadable_profile(tmp_path):
    prof = calibrate(TINY, threads=1, smoke=True, mpi=True)
    path = tmp_path / "cpu.yaml"
    write_profile(prof, str(path))
    hw = load_hardware(str(path))
    assert hw.matmul_flops["float32"] > 1e8 and hw.mem_bw_Bps > 1e8
    assert 0 < hw.inter_link.latency_s < 0.1 and hw.inter_link.bandwidth_Bps > 1e6
    assert hw.inter_link.curve and hw.inter_link.curve[0][0] == 8
    fit = hw.fits["tiny"]
    assert all(math.isfinite(v) for v in (fit.k1, fit.k2, fit.k3, fit.k4, fit.k1_ctx))
    assert isinstance(layer_times_for(hw, TINY, "float32"), FittedTimes)
    assert len(prof["calibration"]["attention"]) == 3 * 2 and len(prof["calibration"]["expert"]) == 3


def test_fit_link_recovers_hockney_model():
    lat, bw = 4e-6, 2e9
    pts = [{"bytes": s, "one_way_s": lat + s / bw} for s in (8, 512, 1 << 16, 1 << 20, 1 << 24)]
    link = fit_link(pts)
    assert link["latency_s"] == pytest.approx(lat + 8 / bw)
    assert link["bandwidth_Bps"] == pytest.approx(bw, rel=1e-6)
    hw = profile_from_dict({"name": "x", "matmul_flops": {"float32": 1e9}, "mem_bw_Bps": 1e9,
                            "mem_bytes": 1e9, "price_per_hour": 0, "inter_link": link})
    # the fitted link reproduces the measured large-message time
    assert hw.inter_link.time(1 << 24) == pytest.approx(lat + (1 << 24) / bw, rel=0.01)


def test_bench_is_swappable_and_unknown_bench_named():
    calls = []

    def make_a(shape, b, ctx, dtype, copies):
        return lambda: calls.append(("a", b, ctx))

    def make_e(shape, b, experts, dtype, copies):
        return lambda: calls.append(("e", b, experts))
    layer_bench.register_bench("fake", make_a, make_e)
    try:
        out = layer_bench.measure_layers(TINY, (1, 2), (8,), 2, bench="fake", rounds=1, repeats=1)
    finally:
        layer_bench.BENCHES.pop("fake")
    assert [x[:2] for x in out["attention"]] == [(1, 8), (2, 8)] and len(out["expert"]) == 2
    assert ("a", 2, 8) in calls and ("e", 1, 2) in calls
    with pytest.raises(ConfigError, match="calibrate.bench='nope'"):
        layer_bench.measure_layers(TINY, (1,), (8,), 2, bench="nope")


def test_shipped_cpu_profile_has_a_fit_for_cpu_small():
    hw = load_hardware("cpu_node")
    assert "cpu_small" in hw.fits and hw.fits["cpu_small"].k4 > 0
    assert "measured" in hw.source
    shape = ModelShape(name="cpu_small", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                       head_dim=64, num_experts=8, top_k=2, moe_intermediate_size=1024, vocab_size=4096)
    t = layer_times_for(hw, shape, "float32")
    assert t.kind == "fitted" and t.t_expert([8]) > t.t_expert([1]) > 0


def test_validate_runtime_reads_run_json(tmp_path):
    import json
    from megainfer.bench.runtime_validation import validate_runtime
    from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
    hw = load_hardware("cpu_node")
    shape = ModelShape(name="cpu_small", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
                       head_dim=64, num_experts=8, top_k=2, moe_intermediate_size=1024, vocab_size=4096)
    t = layer_times_for(hw, shape, "float32")
    pred = DisaggModel(shape, t, t, Workload(32, 16), "float32").predict(Plan(1, 2, 1, 2, 2, 8)).t_iter
    run = {"model": "cpu_small", "batch": 8, "input_len": 32, "output_len": 16,
           "deploy": {"attention_replicas": 2, "attention_tp": 1, "expert_ranks": 2, "micro_batches": 2},
           "decode_iteration_s": pred * 1.25}
    p = tmp_path / "run.json"
    p.write_text(json.dumps(run))
    out = validate_runtime([str(p)])
    assert out["rows"][0]["err"] == pytest.approx(1 / 1.25 - 1)
    assert out["summary"]["target_met"] is False
