"""deploy=auto asks the planner: the split of exactly N ranks moves with the model, explicit
deploy.* keys pin their dimension, the job's prompt lengths reach the planner, and it is fast."""
import json
import time

import pytest
from hydra import compose, initialize_config_module

from megainfer.perfmodel.plan.auto_plan import prompt_lengths
from megainfer.engine.job_doors import settings_from_config
from megainfer.perfmodel.model.disagg import Workload
from megainfer.perfmodel.model.hardware import load_hardware
from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.perfmodel.plan.world_plan import JobLoad, NoWorldPlanError, Pins, plan_world

# same hidden size and layers; one spends its time in attention, the other in experts
ATTN_HEAVY = ModelShape("attn_heavy", hidden_size=512, num_layers=2, num_heads=16, num_kv_heads=16,
                        head_dim=64, num_experts=8, top_k=1, moe_intermediate_size=64, vocab_size=512)
EXPERT_HEAVY = ModelShape("expert_heavy", hidden_size=512, num_layers=2, num_heads=2, num_kv_heads=1,
                          head_dim=32, num_experts=8, top_k=4, moe_intermediate_size=2048,
                          vocab_size=512)
JOB = JobLoad(256, 256, Workload(1024, 64))


def _ratio(c) -> float:
    p = c.plan
    return p.n_a * p.tp_a / (p.n_e * p.tp_e)


@pytest.mark.parametrize("world", [4, 8])
def test_choice_moves_with_the_model(world):
    hw = load_hardware("h100")  # one device per rank: no shared cores
    a = plan_world(ATTN_HEAVY, hw, JOB, world, dtype="bfloat16")[0]
    e = plan_world(EXPERT_HEAVY, hw, JOB, world, dtype="bfloat16")[0]
    assert a.plan.devices == e.plan.devices == world
    assert _ratio(a) > _ratio(e), (a.describe(), e.describe())
    assert a.pred.t_a > a.pred.t_e and e.pred.t_e > e.pred.t_a * 0.5


def test_every_plan_spans_the_world_and_the_best_is_first():
    hw = load_hardware("cpu_node")
    ranked = plan_world(EXPERT_HEAVY, hw, JobLoad(64, 64, Workload(128, 32)), 6)
    assert len(ranked) > 5
    assert all(c.plan.n_a * c.plan.tp_a + c.plan.n_e == 6 for c in ranked)
    tps = [c.pred.tokens_per_s for c in ranked]
    assert tps == sorted(tps, reverse=True)
    assert all(c.plan.m <= c.batch_limit for c in ranked)


def test_pins_hold_and_impossible_pins_are_named():
    hw = load_hardware("cpu_node")
    ranked = plan_world(EXPERT_HEAVY, hw, JOB, 6, Pins(expert_ranks=2, micro_batches=3))
    assert {(c.plan.n_e, c.plan.m) for c in ranked} == {(2, 3)}
    with pytest.raises(NoWorldPlanError, match="deploy pins"):
        plan_world(EXPERT_HEAVY, hw, JOB, 4, Pins(attention_tp=4))


def test_fast_for_64_ranks():
    hw = load_hardware("h100")
    big = ModelShape("big", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                     head_dim=128, num_experts=64, top_k=6, moe_intermediate_size=1408,
                     vocab_size=32000)
    t = time.process_time()
    ranked = plan_world(big, hw, JobLoad(4096, 256, Workload(1024, 256)), 64, dtype="bfloat16")
    assert time.process_time() - t < 1.0
    assert ranked[0].plan.devices == 64


def _settings(*overrides, world):
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return settings_from_config(cfg, world)


def test_launch_runs_the_planners_choice(caplog):
    caplog.set_level("INFO", logger="megainfer.perfmodel")
    d = _settings("deploy.hardware=h100", world=5).deploy
    assert d.mode == "disaggregated" and d.world_size == 5
    log = caplog.text
    assert "[plan] chosen: " in log and "[plan] runner-up: " in log and "hardware h100" in log
    want = f"A{d.attention_replicas}x tp{d.attention_tp} + E{d.expert_ranks}x tp1 m={d.micro_batches}"
    assert want in log.split("[plan] chosen: ")[1].splitlines()[0]


def test_explicit_keys_pin_and_other_modes_skip_the_planner(caplog):
    caplog.set_level("INFO", logger="megainfer.perfmodel")
    d = _settings("deploy.expert_ranks=1", world=4).deploy
    assert d.expert_ranks == 1 and d.attention_ranks == 3
    d = _settings("deploy.mode=disaggregated", world=4).deploy  # the fill-in rule, no planner
    assert (d.attention_replicas, d.attention_tp, d.expert_ranks, d.micro_batches) == (1, 1, 3, 2)
    assert _settings(world=1).deploy.mode == "single"
    assert caplog.text.count("[plan] chosen: ") == 1


def test_job_prompt_lengths_reach_the_planner(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text("\n".join(json.dumps({"id": i, "prompt_token_ids": list(range(100 + i))})
                           for i in range(3)) + "\nnot json\n")
    lens, src = prompt_lengths({"io": {"input": str(p)}})
    assert lens == [100, 101, 102] and "io.input" in src
    lens, _ = prompt_lengths({"workload": {"kind": "random", "num_prompts": 5, "input_len": 77}})
    assert lens == [77] * 5


def _small_memory_profile(tmp_path, mem_bytes: float) -> str:
    import os

    import yaml
    from megainfer.perfmodel.model.hardware import hardware_dir
    with open(os.path.join(hardware_dir(), "cpu_node.yaml")) as f:
        d = yaml.safe_load(f)
    d.update(name="small_mem", mem_bytes=mem_bytes)
    p = tmp_path / "small_mem.yaml"
    p.write_text(yaml.safe_dump(d))
    return str(p)


def test_the_plans_kv_batch_limit_is_applied(tmp_path, caplog):
    """When the profile's KV memory bounds the chosen plan's batch, the scheduler runs no more
    sequences per replica than that; otherwise max_num_seqs is left as given."""
    caplog.set_level("INFO", logger="megainfer.perfmodel")
    job = ("workload=random", "workload.num_prompts=64", "workload.input_len=200")
    small = _settings(f"deploy.hardware={_small_memory_profile(tmp_path, 4e6)}", *job, world=4)
    line = caplog.text.split("[plan] chosen: ")[1].splitlines()[0]
    assert "kv_memory" in line
    limit = int(line.split("/replica")[0].rsplit("(", 1)[1])
    assert 1 <= limit < 64 and small.scheduler.max_num_seqs == limit
    assert f"scheduler.max_num_seqs 64 -> {limit}" in caplog.text
    caplog.clear()
    roomy = _settings(f"deploy.hardware={_small_memory_profile(tmp_path, 1e12)}", *job, world=4)
    assert roomy.scheduler.max_num_seqs == 64 and "batch limit applied" not in caplog.text
    pinned = _settings(f"deploy.hardware={_small_memory_profile(tmp_path, 4e6)}", *job,
                       "deploy.attention_replicas=1", "deploy.attention_tp=1",
                       "deploy.expert_ranks=3", "deploy.micro_batches=1", world=4)
    assert pinned.scheduler.max_num_seqs == 64  # the planner was not asked
