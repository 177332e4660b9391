"""megainfer-launch: config -> settings, input files, the offline job (streaming, resume),
and the console script itself."""
import json
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException

from megainfer import LLM, SamplingParams
from megainfer.config import ConfigError
from megainfer.engine import PromptInput
from megainfer.engine.failures import CoreStartError
from megainfer.launch.inputs import BadLine, InputFileError, read_requests
from megainfer.launch.job import run_offline_job
from mpi_util import mpiexec_path
from megainfer.launch.resume import done_ids
from megainfer.engine.job_doors import settings_from_config


def settings(*overrides, world=1):
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return settings_from_config(cfg, world)


def test_default_config_is_single_tiny_dummy():
    s = settings()
    assert s.deploy.mode == "single" and s.load.load_format == "dummy"
    assert s.model.family == "mixtral" and s.model.eos_token_id == (2,)
    assert s.scheduler.max_model_len == s.model.max_position_embeddings == 1024
    assert s.cache.num_blocks == 64 * 1024 // 16 and s.sampling.temperature == 0
    assert len(s.workload.prompts) == 8 and s.cpu_threads == 1


def test_spin_wait_on_shared_cores_is_warned(caplog):
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        spin = compose("config", overrides=["comm.wait_mode=spin"])
        backoff = compose("config")
    many = (os.cpu_count() or 1) + 1  # more ranks on this host than it has cores
    with caplog.at_level("WARNING", logger="megainfer.launch"):
        settings_from_config(backoff, many, many)
        settings_from_config(spin, 1, 1)
        assert not caplog.records
        s = settings_from_config(spin, many, many)
    assert s.comm.wait_mode == "spin"  # a warning, not an error: the user may know better
    assert len(caplog.records) == 1 and "comm.wait_mode=spin" in caplog.text
    assert f"{many} ranks on {many - 1} cores" in caplog.text


def test_overrides_and_presets(tiny_ckpts):
    path = tiny_ckpts[("qwen2_moe", "base")]
    s = settings(f"model.path={path}", "scheduler.max_model_len=128", "cache.num_blocks=40",
                 "sampling=random", "sampling.max_tokens=5", "workload=random")
    assert s.model.family == "qwen2_moe" and s.load.load_format == "safetensors"
    assert s.scheduler.max_model_len == 128 and s.cache.num_blocks == 40
    assert s.sampling.temperature == 0.8 and s.sampling.max_tokens == 5
    assert s.workload.kind == "random"
    s = settings("deploy=a1e2", world=3)
    assert s.deploy.mode == "disaggregated" and s.deploy.expert_ranks == 2
    s = settings(world=3)  # auto: the planner's plan over exactly 3 ranks
    assert s.deploy.mode == "disaggregated"
    assert s.deploy.attention_ranks + s.deploy.expert_ranks == 3 and s.deploy.expert_ranks >= 1


BAD = [  # (overrides, world, message fragment)
    (["+scheduler.bogus=1"], 1, "scheduler.bogus=1: unknown config key"),
    (["+model.arch.bogus=1"], 1, "model.arch.bogus=1: unknown config key"),
    (["+bogus=1"], 1, "config.bogus=1: unknown config key"),
    (["sampling.top_p=0"], 1, "top_p=0"),
    (["sampling.temperature=-1"], 1, "temperature=-1"),
    (["scheduler.max_model_len=100000"], 1, "scheduler.max_model_len=100000"),
    (["cache.num_blocks=3"], 1, "cache.num_blocks=3"),
    (["deploy=a2e4"], 1, "world size 1 does not match"),
    (["deploy.cpu_threads=0"], 1, "deploy.cpu_threads=0"),
    (["model.arch.family=llama"], 1, "model.family='llama'"),
    (["model.path=/nonexistent/dir"], 1, "model.path='/nonexistent/dir'"),
]


@pytest.mark.parametrize("overrides,world,msg", BAD)
def test_bad_config_is_a_typed_error(overrides, world, msg):
    with pytest.raises(ConfigError) as info:
        settings(*overrides, world=world)
    assert msg in str(info.value)


def test_unknown_key_without_plus_is_refused_by_hydra():
    with pytest.raises(ConfigCompositionException, match="bogus"):
        settings("scheduler.bogus=1")


INPUT_BAD = [  # (file content, message fragment)
    ('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b"\n', ":2: not valid JSON"),
    ('{"id": 1, "prompt": "a"}\n\n[1, 2]\n', ":3: must be a JSON object"),
    ('{"id": 1, "prompt": "a", "prompt_token_ids": [1]}\n', ":1: give exactly one of"),
    ('{"id": 1}\n', ":1: give exactly one of"),
    ('{"id": 1, "promt": "a"}\n', ":1: unknown key 'promt'"),
    ('{"id": 1, "prompt": 5}\n', ":1: 'prompt' must be a string"),
    ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', ":2: duplicate id 1 (first on line 1)"),
    ('{"id": 1, "prompt": "a", "sampling": {"top_k": -5}}\n', ":1: sampling.top_k=-5"),
    ('{"id": 1, "prompt": "a", "sampling": {"temp": 1}}\n', ":1: sampling:"),
    ('{"id": [1], "prompt": "a"}\n', ":1: 'id' must be"),
]


@pytest.mark.parametrize("content,msg", INPUT_BAD)
def test_malformed_input_line_is_named(tmp_path, content, msg):
    p = tmp_path / "in.jsonl"
    p.write_text(content)
    with pytest.raises(InputFileError) as info:  # strict: the file is refused
        read_requests(str(p), SamplingParams(), 0, strict=True)
    assert f"{p}{msg}" in str(info.value)
    bad = [r for r in read_requests(str(p), SamplingParams(), 0) if isinstance(r, BadLine)]
    assert len(bad) == 1 and f"{p}{msg}" in bad[0].error  # else: an error record for the line


def test_input_files(tmp_path):
    j = tmp_path / "in.jsonl"
    j.write_text('{"id": "a", "prompt": "hi"}\n{"prompt_token_ids": [5, 6], '
                 '"sampling": {"max_tokens": 3}}\n')
    reqs = read_requests(str(j), SamplingParams(max_tokens=9), 7)
    assert [r.request_id for r in reqs] == ["a", 2]
    assert reqs[0].prompt == "hi" and reqs[1].prompt_token_ids == [5, 6]
    assert reqs[0].params.max_tokens == 9 and reqs[1].params.max_tokens == 3
    assert reqs[0].params.seed is not None and reqs[0].params.seed != reqs[1].params.seed
    assert read_requests(str(j), SamplingParams(), 7)[0].params.seed == reqs[0].params.seed
    t = tmp_path / "in.txt"
    t.write_text("first prompt\n\nthird line\n")
    reqs = read_requests(str(t), SamplingParams(), 0)
    assert [(r.request_id, r.prompt) for r in reqs] == [(1, "first prompt"), (3, "third line")]
    with pytest.raises(InputFileError, match="io.input='/nope.jsonl': cannot open"):
        read_requests("/nope.jsonl", SamplingParams(), 0)


class CheckedStream:
    """Wraps a generator; when asked for the next output, checks the previous one is on disk."""

    def __init__(self, inner, path):
        self.inner, self.path, self.seen = inner, path, 0

    def generate_stream(self, reqs):
        for out in self.inner.generate_stream(reqs):
            if self.seen:
                with open(self.path) as f:
                    assert len(f.read().splitlines()) == self.seen
            self.seen += 1
            yield out


def _requests(n=6):
    sp = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=6, ignore_eos=True)
    reqs = [PromptInput(f"r{i}", prompt_token_ids=[5 + i] * (3 + 2 * i),
                        params=SamplingParams(**{**sp.__dict__, "seed": 100 + i})) for i in range(n)]
    reqs.append(PromptInput("bad", prompt_token_ids=[10**6], params=sp))
    return reqs


def _lines(path):
    with open(path) as f:
        return {r["id"]: r for r in map(json.loads, f)}


def test_offline_job_streams_and_resumes(tiny_ckpts, tmp_path):
    llm = LLM(tiny_ckpts[("mixtral", "base")], max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16)
    full = tmp_path / "full.jsonl"
    s = run_offline_job(_requests(), CheckedStream(llm, str(full)), str(full), progress=False)
    assert (s.requests, s.errors, s.skipped, s.output_tokens) == (6, 1, 0, 36)
    assert s.ttft_p50_ms > 0 and s.tpot_p99_ms > 0 and s.output_tokens_per_s > 0
    ref = _lines(full)
    assert ref["bad"]["finish_reason"] == "error" and "TokenIdError" in ref["bad"]["error"]
    assert all(len(ref[f"r{i}"]["token_ids"]) == 6 for i in range(6))
    # a killed job: two complete lines, then a torn one
    part = tmp_path / "part.jsonl"
    with open(full) as f:
        lines = f.readlines()
    part.write_text("".join(lines[:2]) + lines[2][:10])
    assert len(done_ids(str(part))) == 2 and part.read_text() == "".join(lines[:2])
    part.write_text("".join(lines[:2]) + lines[2][:10])
    s2 = run_offline_job(_requests(), llm, str(part), progress=False)
    # issue 34: a record that is an error ("bad", refused) runs again; finished ones are skipped
    e = sum(json.loads(line)["finish_reason"] == "error" for line in lines[:2])
    assert (s2.skipped, s2.retried, s2.new) == (2 - e, e, 5) and s2.requests + s2.errors == 5 + e
    got = _lines(part)
    assert len(part.read_text().splitlines()) == 7
    for k in ref:  # seeded per id: the resumed job writes what the uninterrupted one did
        assert got[k]["token_ids"] == ref[k]["token_ids"], k


LAUNCH = [sys.executable, "-m", "megainfer.launch.main"]


def _run(args, tmp_path, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(LAUNCH + args, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_console_default_job(tmp_path):
    r = _run([f"hydra.run.dir={tmp_path}/run", "sampling.max_tokens=8"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "output tokens/s" in r.stdout and "TTFT p50 / p99" in r.stdout
    outs = _lines(tmp_path / "run" / "generations.jsonl")
    assert sorted(outs) == list(range(8)) and all(len(o["token_ids"]) <= 8 for o in outs.values())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["requests"] == 8 and summary["output_tokens_per_s"] > 0


def test_console_errors_and_help(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "a"}\nnot json\n')
    r = _run([f"hydra.run.dir={tmp_path}/run", "io.input=in.jsonl", "io.strict=true"], tmp_path)
    assert r.returncode == 2 and "InputFileError" in r.stderr and "in.jsonl:2" in r.stderr
    r = _run(["+scheduler.bogus=3", f"hydra.run.dir={tmp_path}/run2"], tmp_path)
    assert r.returncode == 2 and "scheduler.bogus=3: unknown config key" in r.stderr
    r = _run(["--help"], tmp_path, timeout=120)
    assert r.returncode == 0 and "megainfer-launch" in r.stdout and "deploy:" in r.stdout
    r = _run(["--cfg", "job", "model=bench50m"], tmp_path, timeout=120)
    assert r.returncode == 0 and "hidden_size: 512" in r.stdout and "max_num_batched_tokens" in r.stdout


def test_console_mistyped_key_names_the_closest(tmp_path):
    r = _run(["deploy.micro_batchs=2", f"hydra.run.dir={tmp_path}/run"], tmp_path, timeout=120)
    assert r.returncode == 1 and "did you mean deploy.micro_batches?" in r.stderr
    assert "+deploy" not in r.stderr and not (tmp_path / "run").exists()


def test_console_mpi_default_job_equals_single(tmp_path):
    """mpiexec -n 3: the default job on 1 attention + 2 expert ranks writes single mode's tokens."""
    try:
        mpiexec = mpiexec_path()
    except CoreStartError as e:
        pytest.skip(str(e))
    args = ["io.progress=false", "sampling.max_tokens=6"]
    single = _run(args + [f"hydra.run.dir={tmp_path}/single"], tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([mpiexec, "-n", "3"] + LAUNCH + args + [f"hydra.run.dir={tmp_path}/mpi"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "summary (disaggregated" in r.stdout
    want = {k: v["token_ids"] for k, v in _lines(tmp_path / "single" / "generations.jsonl").items()}
    got = {k: v["token_ids"] for k, v in _lines(tmp_path / "mpi" / "generations.jsonl").items()}
    assert got == want and len(got) == 8


def _attention_params(ckpt: str, layer: int) -> int:
    """Attention projection weights of one layer, counted off the checkpoint (norms, biases out)."""
    from safetensors import safe_open
    n = 0
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        for k in f.keys():
            if f".layers.{layer}.self_attn." in k and k.endswith(("proj.weight", "mqa.weight")):
                n += f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1]
    return n


def test_plan_reads_a_checkpoint_of_each_family(tiny_ckpts, tmp_path, capsys):
    from megainfer.config import ModelConfig
    from megainfer.launch.plan import LEGEND, _rewrite_argv, _run, _shape
    from megainfer.tools.make_tiny import make_tiny
    ckpts = {f: tiny_ckpts[(f, "base")] for f in ("mixtral", "qwen2_moe", "qwen3_moe")}
    for f in ("deepseek_v2", "deepseek_v3"):
        ckpts[f] = make_tiny(f, str(tmp_path / f), seed=1, chat_template=False)
    for fam, d in ckpts.items():
        argv = _rewrite_argv([f"model.path={d}", "hardware=cpu_node", "dtype=float32", "top=1",
                              "colocated=false", "out.timeline=false", f"out.dir={tmp_path}/o",
                              "search.replica_choices=[1,2]", "search.tp_choices=[1]"])
        with initialize_config_module(config_module="megainfer.conf", version_base=None):
            cfg = compose("plan", overrides=argv)
        shape, mc = _shape(cfg), ModelConfig.from_pretrained(d)
        assert (shape.name, shape.hidden_size, shape.num_experts, shape.top_k) == (
            os.path.basename(d), mc.hidden_size, mc.num_experts, mc.top_k), fam
        assert shape.attn_params == _attention_params(d, mc.moe_layers()[0]), fam
        if fam.startswith("deepseek"):  # the latent cache: one kv_lora_rank + rope row a token
            assert shape.kv_elems == mc.kv_lora_rank + mc.qk_rope_head_dim == 40
            assert shape.shared_intermediate_size == mc.n_shared_experts * mc.moe_intermediate_size
        else:
            assert shape.kv_elems == 2 * mc.num_kv_heads * mc.head_dim
        _run(cfg)
        out = capsys.readouterr().out
        assert f"[plan] model={os.path.basename(d)} " in out, fam
        table = out.split("binding\n", 1)[1].splitlines()
        assert table[1] == LEGEND  # the table's one row, then its legend
        assert json.loads((tmp_path / "o" / "plans.json").read_text())["model"] == os.path.basename(d)
    # the launcher's tiny preset plans too, and --help lists the plan's own model presets
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("plan", overrides=_rewrite_argv(["model=tiny"]))
    assert _shape(cfg).name == "tiny" and _shape(cfg).hidden_size == 64
    exe = os.path.join(os.path.dirname(sys.executable), "megainfer-plan")
    h = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120).stdout
    assert "model=NAME, a shape preset: cpu_small, deepseek_v3," in h and "model.path=DIR" in h
    assert "launcher's models: bench50m, tiny" in h and "== Configuration groups ==" not in h
