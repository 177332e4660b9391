"""``LLM(deploy=...)`` and ``AsyncLLM(deploy=...)`` under ``mpiexec -n N python script.py`` give
what single mode gives (and so Hugging Face's greedy tokens): greedy and seeded samples, n,
logprobs, stop strings, chat; streams grow token by token, aborts end with "abort" and give
their blocks back, requests added while others run. The script's code after ``LLM(...)`` runs
on rank 0 only and every rank exits 0. (Ranks started from a plain script: test_spawned_core.)"""
import json
import os
import sys

import pytest

from mpi_util import run_mpi
from repo_paths import MPI_PROGS

sys.path.insert(0, MPI_PROGS)
from llm_deploy_job import ENGINE_ARGS, async_outputs, offline_outputs  # noqa: E402

JOB = os.path.join(MPI_PROGS, "llm_deploy_job.py")
A2E2 = {"mode": "disaggregated", "attention_replicas": 2, "attention_tp": 1, "expert_ranks": 2,
        "micro_batches": 2}
TP2 = {"mode": "disaggregated", "attention_replicas": 1, "attention_tp": 2, "expert_ranks": 1,
       "micro_batches": 1}
P1A2E1 = {"mode": "disaggregated", "attention_replicas": 2, "attention_tp": 1, "expert_ranks": 1,
          "micro_batches": 1, "prefill_replicas": 1}  # PD with two decode replicas


@pytest.fixture(scope="module")
def deepseek_ckpt(tmp_path_factory):
    from megainfer.tools.make_tiny import make_tiny
    return make_tiny("deepseek_v3", str(tmp_path_factory.mktemp("dsv3") / "v3"), seed=1,
                     chat_template=False)


def _single(ckpt, what, **kw):
    """Single mode in this process on the same job (``kw``: more LLM arguments)."""
    from megainfer import AsyncLLM, LLM
    kw = dict(ENGINE_ARGS, **kw)
    if what == "offline":
        return offline_outputs(LLM(ckpt, **kw))
    engine = AsyncLLM(ckpt, **kw)
    try:
        return async_outputs(engine)
    finally:
        engine.shutdown()


def _run(tmp_path, ranks, ckpt, deploy, what):
    out = tmp_path / "out.json"
    arg = deploy if isinstance(deploy, str) else json.dumps(deploy)
    run_mpi(ranks, JOB, [out, ckpt, arg, what], timeout=400)
    after = sorted(p.name for p in tmp_path.iterdir() if ".after." in p.name)
    assert after == ["out.json.after.0"]  # the code after LLM(...) ran once, on rank 0
    return json.loads(out.read_text())


OFFLINE = [("a1e2", 3, "a1e2"), ("a2e2m2", 4, A2E2), ("a1tp2e1", 3, TP2),
           ("colocated2", 2, "colocated2"), ("p1a1e2", 4, "p1a1e2")]


def _valid_structured(texts) -> None:
    """offline_outputs' structured outputs follow their grammars (JSON schema, regex)."""
    import re

    import jsonschema_rs
    from llm_deploy_job import SCHEMA
    valid = jsonschema_rs.validator_for(SCHEMA).is_valid
    assert all(valid(json.loads(t)) for t in texts[0] + texts[1]), texts
    assert all(re.fullmatch(r"[a-e]{2,5}\d", t) for t in texts[2]), texts


@pytest.mark.parametrize("name,ranks,deploy", OFFLINE, ids=[o[0] for o in OFFLINE])
def test_llm_every_mode_equals_single_mode(tiny_ckpts, tmp_path, name, ranks, deploy):
    ckpt = tiny_ckpts[("mixtral", "base")]
    got = _run(tmp_path, ranks, ckpt, deploy, "offline")
    want = _single(ckpt, "offline")
    for key in want.keys() - {"logprobs"}:
        assert got[key] == want[key], (name, key)
    _valid_structured(got["structured"])
    _same_logprobs(got["logprobs"], want["logprobs"])
    assert max(got["idle_cpu"]) < 0.05, got["idle_cpu"]  # an idle runtime sleeps, every rank


def test_deploy_auto_planning_a_server_runs_its_pd_plan_equal_to_single_mode(tiny_ckpts, tmp_path):
    """``deploy=auto`` with ``slo.arrival_rate`` under ``mpiexec -n 4``: every rank plans on its
    own, they agree on the planner's PD split (a tight TTFT SLO: 2 prefill replicas feeding
    A1 + E1, tests/unit/perfmodel/test_world_serving.py) and serve single mode's outputs."""
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "out.json"
    slo = ["slo.arrival_rate=4", "slo.ttft_ms=12", "slo.tpot_ms=50", "slo.input_len=64",
           "slo.output_len=64"]
    run_mpi(4, JOB, [out, ckpt, "auto", "offline", *slo], timeout=400)
    got = json.loads(out.read_text())
    assert (got["plan"]["prefill_replicas"], got["plan"]["attention_replicas"],
            got["plan"]["expert_ranks"]) == (2, 1, 1), got["plan"]
    want = _single(ckpt, "offline")
    for key in ("greedy", "greedy_text", "seeded", "stop", "chat"):
        assert got[key] == want[key], key
    _same_logprobs(got["logprobs"], want["logprobs"])


def _same_logprobs(got, want):
    """The same tokens; values as close as a different summation order allows (the expert
    ranks add their partial sums in another order than single mode)."""
    assert [[[t for t, _ in pos] for pos in o] for o in got] == \
        [[[t for t, _ in pos] for pos in o] for o in want]
    flat = lambda x: [v for o in x for pos in o for _, v in pos]  # noqa: E731
    assert flat(got) == pytest.approx(flat(want), abs=1e-4)


def test_llm_deepseek_v3_disaggregated_equals_single_mode(deepseek_ckpt, tmp_path):
    got = _run(tmp_path, 3, deepseek_ckpt, "a1e2", "offline")
    want = _single(deepseek_ckpt, "offline")
    assert got["greedy"] == want["greedy"] and got["seeded"] == want["seeded"]


def _check_streams(got, want):
    for i, (g, w) in enumerate(zip(got["streams"], want["streams"])):
        assert g["tokens"] == w["tokens"] and g["finish"] == w["finish"], i
        assert g["seen"] == sorted(g["seen"]) and g["seen"][-1] == len(g["tokens"][0]), i
        assert len(g["seen"]) >= 2 and g["finished"], i  # it streamed, then ended
        if len(g["tokens"][0]) >= 6:  # on whichever replica: more than first and last token
            assert len(g["seen"]) >= 3, (i, g["seen"])
    for g, w in zip(got["grammar"], want["grammar"]):  # JSON-schema streams
        assert g["tokens"] == w["tokens"] and g["finished"]
        texts = [bytes(t for t in toks if t != 2).decode() for toks in g["tokens"]]
        _valid_structured([texts, [], []])
    for key in ("aborted", "early", "at_once"):
        assert got[key]["finish"] == ["abort"] and got[key]["finished"], key
        assert len(got[key]["tokens"][0]) < 100, key  # ended well before its max_tokens
    free, total = got["free_blocks"]
    assert free == total  # every block back at the idle level (prefix caching off)
    assert got["engine_detokenizes"] is False  # rank 0's replica too: the frontend decodes


@pytest.mark.parametrize("name,ranks,deploy", [("a1e2", 3, "a1e2"), ("p1a1e2", 4, "p1a1e2"),
                                               ("p1a2e1", 4, P1A2E1)],
                         ids=["a1e2", "p1a1e2", "p1a2e1"])
def test_async_llm_streams_and_aborts_in_every_mode(tiny_ckpts, tmp_path, name, ranks, deploy):
    ckpt = tiny_ckpts[("mixtral", "base")]
    got = _run(tmp_path, ranks, ckpt, deploy, "async")
    want = _single(ckpt, "async")
    _check_streams(want, want)  # the reference itself streams, aborts and frees its blocks
    _check_streams(got, want)


def test_a_rank_that_hangs_raises_naming_it_within_the_timeout(tiny_ckpts, tmp_path):
    """An expert rank frozen mid-generate (SIGSTOP): LLM.generate raises RankLostError naming
    it and its role within comm.timeout_s (the attention rank waits that long; + slack), and
    the job leaves no process behind."""
    import subprocess

    from mpi_util import mpiexec_path
    out, timeout_s = tmp_path / "out.json", 6
    job = os.path.join(MPI_PROGS, "llm_hang_job.py")
    cmd = [mpiexec_path(), "-n", "3", sys.executable, job, str(out),
           tiny_ckpts[("mixtral", "base")], "2", str(timeout_s)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    got = json.loads(out.read_text())
    assert got["raised"] == "RankLostError", (got, p.stderr[-2000:])
    assert got["rank"] == 2 and got["role"] == "[expert 1]", got
    assert got["seconds"] < timeout_s + 8, got
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout
    assert not left.strip(), left


def test_the_batch_example_runs_under_mpiexec_and_self_spawned(tiny_ckpts):
    """examples/batch_deploy.py: the same outputs as `mpiexec -n 3 python ...` and as a plain
    `python ...` that starts its three ranks itself."""
    import subprocess

    from mpi_util import mpiexec_path
    from repo_paths import REPO
    example = os.path.join(REPO, "examples", "batch_deploy.py")
    args = [example, tiny_ckpts[("mixtral", "base")], "--deploy", "a1e2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = [subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
            for cmd in ([mpiexec_path(), "-n", "3", sys.executable, *args],
                        [sys.executable, *args])]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.count("Prompt: ") == 3 and "a1e2: done, 3 outputs" in r.stdout
    assert runs[0].stdout == runs[1].stdout
