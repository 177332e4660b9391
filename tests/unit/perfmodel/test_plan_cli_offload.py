"""megainfer-plan's goodput planning considers the decode-attention offload beside plain PD and
AE and prints which it chose and why, in deploy=auto's words (offload_choice): over exactly N
ranks (goodput.world_size, plan_world_serving as deploy=auto plans a server) the tiny model on
a profile whose KV memory holds about 20 sequences per decode replica picks the offload; the
per-dollar search (goodput.world_size null) simulates its best PD candidate offloaded too and
says why the offload ranked below."""
import json

from hydra import compose, initialize_config_module

from perfmodel_helpers import synthetic_profile
from test_world_serving_offload import KV_BOUND

# test_world_serving's TINY (make_tiny's Mixtral defaults) as plan_model overrides
TINY_SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  num_experts=4, top_k=2, moe_intermediate_size=64, vocab_size=256)
# 2000 requests/s of 64 / 128 tokens, 10 ms / 1 ms SLOs, as test_world_serving_offload
SERVING = ["workload.arrival_rate=2000", "workload.input_len=64", "workload.output_len=128",
           "workload.num_requests=64", "slo.ttft_ms=10", "slo.tpot_ms=1", "dtype=float32",
           "use_fit=false", "goodput.max_batch=64", "goodput.max_num_batched_tokens=512"]


def _flat(d: dict, prefix: str) -> list:
    out = []
    for k, v in d.items():
        out += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}={v}"]
    return out


def _plan(tmp_path, capsys, *overrides) -> tuple[str, dict]:
    from megainfer.launch.plan import _run
    hw = synthetic_profile("kv_bound", **KV_BOUND)
    ov = ["plan_model@model=mixtral_8x7b", "model.name=tiny",
          *(f"model.{k}={v}" for k, v in TINY_SHAPE.items()),
          *_flat({k: v for k, v in hw.items() if k != "matmul_flops"}, "hardware."),
          f"hardware.matmul_flops.float32={hw['matmul_flops']['float32']}",
          *SERVING, f"out.dir={tmp_path}", *overrides]
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        _run(compose("plan", overrides=ov))
    with open(tmp_path / "goodput.json") as f:
        return capsys.readouterr().out, json.load(f)


def _line(text: str, start: str) -> str:
    hits = [x for x in text.splitlines() if x.startswith(start)]
    assert len(hits) == 1, text
    return hits[0]


def test_over_n_ranks_megainfer_plan_chooses_the_offload_and_says_why(tmp_path, capsys):
    text, res = _plan(tmp_path, capsys, "goodput.world_size=4")
    assert "exactly 4 ranks (as deploy=auto plans a server)" in text
    chosen = _line(text, "[goodput] chosen: PD P1x tp1[kv_bound] -> ")
    assert "batch<=64/replica offload=1: " in chosen
    assert ("(decode attention offloaded: goodput 1960 req/s, 100% meet both, against goodput "
            "1868 req/s, 95% meet both for the best plan without it, P1x tp1[kv_bound] -> "
            "A1x tp2[kv_bound] + E1x tp1[kv_bound] m=2 batch<=42/replica; pd.offload=true "
            "pd.offload_ratio=1 runs it)") in chosen
    assert "not chosen" not in text
    assert res["plans"][0]["keys"] == "pd.offload=true pd.offload_ratio=1"
    assert {p["family"] for p in res["plans"]} == {"AE", "PD"}
    assert {p["offload_ratio"] for p in res["plans"]} == {0.0, 0.5, 1.0}


def test_the_per_dollar_search_says_why_the_offload_ranked_below(tmp_path, capsys):
    text, res = _plan(tmp_path, capsys)
    chosen = _line(text, "[goodput] chosen: AE ")
    assert "offload" not in chosen
    why = _line(text, "[goodput] decode-attention offload not chosen: its best plan, P1x ")
    assert " offload=" in why and "req/$), ranks below the chosen A" in why
    assert why.endswith("on fewer requests per dollar; pd.offload stays false")
    assert [p["offload_ratio"] for p in res["plans"]][0] == 0.0


def test_the_keys_line_says_what_the_runtime_still_needs():
    from dataclasses import replace

    from megainfer.perfmodel.plan.auto_plan import model_shape
    from megainfer.perfmodel.plan.offload_choice import runs_it
    from test_world_serving import TINY
    shape = model_shape(TINY)
    assert runs_it(1, 2, shape) == runs_it(2, 2, shape) == "runs it"
    assert runs_it(2, 1, shape) == ("would run it (the runtime needs deploy.prefill_tp=1 or "
                                    "deploy.attention_tp=1 for now (got 2))")
    assert "cache.kv_cache_dtype=auto" in runs_it(1, 1, replace(shape, kv_cache_dtype="fp8_e4m3"))
