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


@pytest.fixture(scope="module")
def deepseek_ckpt(tmp_path_factory):
    from megainfer.tools.make_tiny import make_tiny
    return make_tiny("deepseek_v3", str(tmp_path_factory.mktemp("dsv3") / "v3"), seed=1,
                     chat_template=False)


def _single(ckpt, what):
    from megainfer import AsyncLLM, LLM
    if what == "offline":
        return offline_outputs(LLM(ckpt, **ENGINE_ARGS))
    engine = AsyncLLM(ckpt, **ENGINE_ARGS)
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


@pytest.mark.parametrize("name,ranks,deploy", OFFLINE, ids=[o[0] for o in OFFLINE])
def test_llm_every_mode_equals_single_mode(tiny_ckpts, tmp_path, name, ranks, deploy):
    ckpt = tiny_ckpts[("mixtral", "base")]
    got = _run(tmp_path, ranks, ckpt, deploy, "offline")
    want = _single(ckpt, "offline")
    for key in want:
        assert got[key] == want[key], (name, key)


def test_llm_deepseek_v3_disaggregated_equals_single_mode(deepseek_ckpt, tmp_path):
    got = _run(tmp_path, 3, deepseek_ckpt, "a1e2", "offline")
    want = _single(deepseek_ckpt, "offline")
    assert got["greedy"] == want["greedy"] and got["seeded"] == want["seeded"]


def _check_streams(got, want):
    for i, (g, w) in enumerate(zip(got["streams"], want["streams"])):
        assert g["tokens"] == w["tokens"] and g["finish"] == w["finish"], i
        assert g["seen"] == sorted(g["seen"]) and g["seen"][-1] == len(g["tokens"][0]), i
        assert len(g["seen"]) >= 2 and g["finished"], i  # it streamed, then ended
    for key in ("aborted", "early"):
        assert got[key]["finish"] == ["abort"] and got[key]["finished"], key
        assert len(got[key]["tokens"][0]) < 100, key  # ended well before its max_tokens
    free, total = got["free_blocks"]
    assert free == total  # every block back at the idle level (prefix caching off)


@pytest.mark.parametrize("name,ranks,deploy", [("a1e2", 3, "a1e2"), ("p1a1e2", 4, "p1a1e2")],
                         ids=["a1e2", "p1a1e2"])
def test_async_llm_streams_and_aborts_in_every_mode(tiny_ckpts, tmp_path, name, ranks, deploy):
    ckpt = tiny_ckpts[("mixtral", "base")]
    got = _run(tmp_path, ranks, ckpt, deploy, "async")
    want = _single(ckpt, "async")
    _check_streams(want, want)  # the reference itself streams, aborts and frees its blocks
    _check_streams(got, want)
