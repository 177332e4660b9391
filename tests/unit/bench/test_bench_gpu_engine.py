"""perf/bench/bench_gpu_engine.py end to end on cpu with tiny shapes: every row written, sane numbers."""
import json
import math

from perf_util import run_perf

from megainfer.bench import decode_roofline as bench


def test_bench_gpu_engine_tiny_cpu(tmp_path):
    out = tmp_path / "bench.json"
    run_perf("bench/bench_gpu_engine.py", ["--device", "cpu", "--tiny", "--out", out])
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["input_len"] == 16 and res["output_len"] == 8
    bw = res["copy"]
    assert bw["bw_rw"] > 0 and math.isclose(bw["bw_rw"], 2 * bw["bw_n_over_t"])
    systems = ("megainfer", "hf", "megainfer-eager")
    rows = {(r["model"], r["system"], r["batch"]): r for r in res["rows"]}
    assert set(rows) == {(m, s, b) for m in bench.MODELS for s in systems for b in (1, 4)}
    for key, r in rows.items():
        assert "error" not in r and "skipped" not in r, (key, r)
        assert r["total_s"] > 0 and r["prefill_s"] > 0 and r["output_tok_s"] > 0, (key, r)
        assert r["decode_step_s"] > 0, (key, r)
        q = r["roofline"]
        assert q["bytes_per_step"] > q["weight_bytes"] > 0 and q["kv_bytes"] > 0, (key, q)
        assert math.isfinite(q["roofline_frac"]) and 0 < q["roofline_frac"], (key, q)
        assert 0 < q["experts_touched_per_layer"] <= res["models"][key[0]]["num_experts"]
        if key[1] != "hf":
            # the prefill fits one step: output_len steps in all
            assert r["engine_steps"] == res["output_len"], (key, r)
    for m in bench.MODELS:  # 2 layers, the real family and routing
        assert res["models"][m]["num_layers"] == 2
    ratios = {(x["model"], x["system"], x["batch"]) for x in res["ratios"]}
    assert ratios == {(m, s, b) for m in bench.MODELS for s in systems[::2] for b in (1, 4)}


def test_roofline_bytes_by_hand():
    """Mixtral-8x7B cut to 8 layers, bf16, batch 1 at context 384: 2 of 8 experts per layer."""
    cfg = bench.model_config("mixtral_8x7b", 8, tiny=False)
    q = bench.decode_roofline(cfg, 1, 384, 2)
    assert math.isclose(q["experts_touched_per_layer"], 2)
    H, V = 4096, 32000
    attn = H * (4096 + 2 * 1024) + 4096 * H + 2 * H
    weights = 8 * (attn + H * 8 + 2 * 3 * H * 14336) + H + V * H + H
    assert math.isclose(q["weight_bytes"], 2 * weights)
    assert math.isclose(q["kv_bytes"], 384 * 8 * 2 * 8 * 128 * 2)
    # a large batch touches every expert
    assert math.isclose(bench.decode_roofline(cfg, 256, 384, 2)["experts_touched_per_layer"], 8)
