"""One config resolution for LLM and the launcher (megainfer.engine.resolve): each check once,
LLM's vLLM-named arguments and every launcher key, model ids from the local Hugging Face
cache, and errors that name the Python argument or the closest known key."""
import dataclasses
import os
import shutil

import pytest
import torch
from hydra import compose, initialize_config_module

import megainfer.models.loader as loader
from megainfer import LLM, SamplingParams
from megainfer.config import ConfigError, DeviceConfig, LoadConfig, ModelConfig, ResolvedJob
from megainfer.engine.resolve import kv_budget_gib
from megainfer.launch.overrides import job_config_text, override_key_error
from megainfer.engine.job_doors import JobSettings, settings_from_config

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
TINY = ModelConfig(family="mixtral", vocab_size=300, hidden_size=32, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=16, num_experts=2, top_k=1, moe_intermediate_size=32,
                   max_position_embeddings=64)


def settings(*overrides, world=1):
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return settings_from_config(cfg, world)


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------ one resolution, checks once
def test_launcher_and_llm_resolve_the_same_job(tiny_ckpts, monkeypatch, threads):
    path = tiny_ckpts[("qwen3_moe", "base")]
    calls = []
    real = DeviceConfig.check_model
    monkeypatch.setattr(DeviceConfig, "check_model",
                        lambda self, *a: calls.append(1) or real(self, *a))
    s = settings(f"model.path={path}", "scheduler.max_model_len=128", "scheduler.max_num_seqs=4")
    assert isinstance(s, JobSettings) and isinstance(s, ResolvedJob)
    llm = LLM.from_job(s)  # the launcher's single mode: no check repeated after the resolution
    assert len(calls) == 1
    direct = LLM(path, max_model_len=128, max_num_seqs=4)
    assert len(calls) == 2
    for f in ("model", "load", "scheduler", "cache", "deploy", "device", "seed", "cpu_threads"):
        assert getattr(direct.job, f) == getattr(s, f), f
    assert llm.generate("abc", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        direct.generate("abc", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_torch_dtype_replaces_the_tables():
    assert LoadConfig(load_format="dummy", dtype="bfloat16").torch_dtype is torch.bfloat16
    assert LoadConfig(load_format="dummy").torch_dtype is torch.float32
    assert not hasattr(loader, "DTYPES")
    import megainfer.runtime.rank_parts as rank_parts
    assert not hasattr(rank_parts, "DTYPES") and not hasattr(rank_parts, "JobSpec")


def test_weight_bytes_counts_the_built_model():
    model = loader.build_model(TINY, LoadConfig(load_format="dummy"))
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    assert loader.weight_bytes(TINY, torch.float32) == n
    assert kv_budget_gib(0.5, 10 * 2**30, 2 * 2**30) == pytest.approx(3.0)
    with pytest.raises(ConfigError, match="gpu_memory_utilization=0.1: 10% of the 10.00 GiB"):
        kv_budget_gib(0.1, 10 * 2**30, 2 * 2**30)


# ------------------------------------------------------------------ LLM's arguments
def test_vllm_names_and_threads(monkeypatch, threads):
    seen = {}
    import megainfer.engine.resolve as resolve_mod  # where LLM's arguments are resolved
    real = resolve_mod.resolve_job
    monkeypatch.setattr(resolve_mod, "resolve_job",
                        lambda tree, *a, **k: seen.setdefault("tree", tree) and real(tree, *a, **k))
    llm = LLM(TINY, enforce_eager=True, max_num_seqs=3, seed=5)
    assert seen["tree"]["engine"]["cuda_graphs"] is False
    assert llm.job.scheduler.max_num_seqs == 3 and llm.job.seed == 5 and llm.job.load.seed == 5
    assert llm.job.cpu_threads == 1 and torch.get_num_threads() == 1  # the launcher's rule
    LLM(TINY, cpu_threads=2)
    assert torch.get_num_threads() == 2
    block = 16 * 2 * 16 * 4  # tokens x (k, v) x head_dim x float32, one layer, one KV head
    llm = LLM(TINY, gpu_memory_utilization=0.9, kv_cache_memory_gib=100 * block / 2**30)
    assert llm.job.cache.num_blocks == 100  # on cpu the pool is kv_cache_memory_gib
    llm = LLM(TINY, overrides=["comm.timeout_s=20", "scheduler.routing=round_robin"])
    assert llm.job.comm.timeout_s == 20 and llm.job.scheduler.routing == "round_robin"


@pytest.mark.parametrize("kw,match", [
    (dict(max_num_seqs=0), r"^LLM\(max_num_seqs=0\): scheduler.max_num_seqs=0"),
    (dict(trust_remote_code=True), r"^LLM\(trust_remote_code=True\): refused"),
    (dict(overrides=["comm.timeout_s=0"]), r"^LLM\(overrides=\['comm.timeout_s=0'\]\): comm"),
    (dict(overrides=["deploy.micro_batchs=2"]), r"did you mean deploy.micro_batches\?"),
    (dict(overrides=["sampling.temperature=0"]), r"give SamplingParams to generate"),
    (dict(deploy="a1e3"), r"deploy='a1e3': no such deploy preset \(did you mean 'a1e2'\?"),
    (dict(tensor_parallel_size=2), r"^LLM\(tensor_parallel_size=2\): world size 1"),
    (dict(deploy="a1e2", world_size=2), r"^LLM\(deploy='a1e2', world_size=2\): world size 2"),
    (dict(kv_cache_dtype="fp16"), r"^LLM\(kv_cache_dtype='fp16'\): cache.kv_cache_dtype"),
])
def test_errors_name_the_argument(kw, match, threads):
    with pytest.raises(ConfigError, match=match):
        LLM(TINY, **kw)


@pytest.mark.parametrize("kw,ranks,mode", [
    (dict(deploy="a1e2"), 3, "disaggregated"),
    (dict(deploy="p1a1e2"), 4, "disaggregated"),
    (dict(deploy="colocated2"), 2, "colocated"),
    (dict(deploy="auto", world_size=3), 3, "disaggregated"),
    (dict(deploy={"mode": "disaggregated", "expert_ranks": 2}, world_size=3), 3, "disaggregated"),
    (dict(tensor_parallel_size=2, world_size=3), 3, "disaggregated"),
])
def test_other_modes_resolve_to_the_launchers_plan(kw, ranks, mode, threads):
    """What LLM(deploy=...) would start (the ranks themselves: tests/distributed)."""
    from megainfer.engine.job_doors import resolve_llm_job
    args = {}
    tp = kw.pop("tensor_parallel_size", None)
    if tp is not None:
        args["tensor_parallel_size"] = tp
    got = resolve_llm_job(args, TINY, kw.get("deploy"), tp, kw.get("world_size"), ())
    assert got.job.deploy.mode == mode and got.job.deploy.world_size == ranks
    assert got.spec.world_size == ranks
    # every rank resolves the same plan for itself (deploy=auto: the planner asked on each)
    assert got.spec.resolve(ranks - 1, holds_cache=False).deploy == got.job.deploy
    if tp is not None:
        assert got.job.deploy.attention_tp == tp


@pytest.fixture
def fake_gpu(monkeypatch):
    """One visible 80 GiB "GPU" (40 GiB free): ``calls`` records each ``mem_get_info``, the
    call that opens a CUDA context."""
    from types import SimpleNamespace
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda i=None: calls.append(i) or (40 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=None: SimpleNamespace(total_memory=80 * 2**30))
    return calls


@pytest.mark.parametrize("deploy,engine_process,measures", [
    ("single", False, True),   # single mode's core in this process: its own pool, measured
    ("single", True, False),   # AsyncLLM(engine_process=True): the child job measures
    ("a1e2", False, False),    # a plain script starting its ranks: a frontend
])
def test_a_frontend_never_opens_a_cuda_context_to_size_the_kv_pool(fake_gpu, deploy,
                                                                    engine_process, measures):
    """``gpu_memory_utilization`` on cuda: the process that builds the pool measures free
    memory (``mem_get_info``); one that only fronts the ranks reads the total instead, so it
    holds no CUDA context (GPU memory for its life; a GPU in exclusive-process mode refusing
    the ranks)."""
    from megainfer.engine.job_doors import resolve_llm_job
    args = {"gpu_memory_utilization": 0.5, "num_blocks": None, "device": "cuda",
            "attention_backend": "torch"}
    got = resolve_llm_job(args, TINY, deploy, None, None, ["deploy.device=cuda"],
                          engine_process=engine_process)
    assert bool(fake_gpu) == measures
    assert got.job.device.device == "cuda" and got.job.cache.num_blocks > 0
    served = settings_from_config({"model": {"arch": TINY, "attention_backend": "torch"},
                                   "deploy": {"mode": "single", "device": "cuda"},
                                   "cache": {"gpu_memory_utilization": 0.5}},
                                  holds_cache=False)  # megainfer-serve's frontend
    assert served.cache.num_blocks > 0 and bool(fake_gpu) == measures  # no call of its own


# ------------------------------------------------------------------ the local Hugging Face cache
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root, ckpt, repo="org/tiny", ref="main"):
    d = root / f"models--{repo.replace('/', '--')}"
    (d / "refs").mkdir(parents=True)
    (d / "refs" / ref).write_text(COMMIT)
    shutil.copytree(ckpt, d / "snapshots" / COMMIT)
    return str(d / "snapshots" / COMMIT)


def test_model_id_from_the_local_cache(tiny_ckpts, tmp_path, monkeypatch, threads):
    ckpt = tiny_ckpts[("mixtral", "base")]
    snap = fake_cache(tmp_path / "hub", ckpt)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    want = LLM(ckpt, max_model_len=64).generate("abc", GREEDY, use_tqdm=False)[0]
    llm = LLM("org/tiny", max_model_len=64)
    assert os.path.samefile(llm.job.load.path, snap)
    assert llm.generate("abc", GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        want.outputs[0].token_ids
    assert os.path.samefile(LLM("org/tiny", revision=COMMIT, max_model_len=64).job.load.path, snap)
    assert os.path.samefile(settings("model.path=org/tiny").load.path, snap)
    with pytest.raises(ConfigError, match=r"LLM\(model='org/missing'\).*not in the local Hugging "
                       r"Face cache.*`hf download org/missing`"):
        LLM("org/missing")
    with pytest.raises(ConfigError, match=r"`hf download org/tiny --revision v2`"):
        LLM("org/tiny", revision="v2")
    with pytest.raises(ConfigError, match=r"model.revision='v2': a revision selects"):
        LLM(ckpt, revision="v2")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # $HF_HOME/hub
    assert os.path.samefile(LLM("org/tiny", max_model_len=64).job.load.path, snap)


# ------------------------------------------------------------------ errors with a way out
def test_missing_directory_says_so():
    with pytest.raises(ConfigError, match=r"model.path='/nonexistent/dir': no such directory$"):
        ModelConfig.from_pretrained("/nonexistent/dir")
    with pytest.raises(ConfigError, match="no such directory"):
        settings("model.path=/nonexistent/dir")


def test_mistyped_key_gets_the_closest_one():
    e = override_key_error(["deploy=a1e2", "deploy.micro_batchs=2"])
    assert str(e).startswith("deploy.micro_batchs=2: unknown config key (did you mean "
                             "deploy.micro_batches?")
    assert "model.arch.hidden_size?" in str(override_key_error(["model.arch.hiden_size=8"]))
    assert "did you mean deploy?" in str(override_key_error(["deploi=a1e2"]))
    assert override_key_error(["deploy=a1e2", "model.path=x", "+scheduler.bogus=1",
                               "hydra.run.dir=.", "comm.timeout_s=3"]) is None
    with pytest.raises(ConfigError, match="did you mean scheduler.max_num_seqs"):
        settings("+scheduler.max_num_seq=3")


def test_cfg_job_shows_the_checkpoint_architecture(tiny_ckpts):
    path = tiny_ckpts[("qwen2_moe", "base")]
    want = ModelConfig.from_pretrained(path)
    text = job_config_text(["--cfg", "job", f"model.path={path}"])
    assert f"read from {path}" in text and "family: qwen2_moe" in text
    assert f"hidden_size: {want.hidden_size}" in text and "family: mixtral" not in text
    text = job_config_text(["--cfg", "job", "model.path=/nonexistent/dir"])
    assert "at run time" in text and "no such directory" in text


def test_bundle_is_what_the_runtime_takes():
    s = settings("deploy=a1e2", world=3)
    job = dataclasses.replace(s, deploy=dataclasses.replace(s.deploy, prefill_replicas=0))
    assert isinstance(job, ResolvedJob) and job.scheduler is s.scheduler
