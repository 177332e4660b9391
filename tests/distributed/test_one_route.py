"""One route for every request: the same greedy request through ``LLM``, ``AsyncLLM``,
``megainfer-serve`` and ``megainfer-launch``'s offline job, in single mode and a1e2, each in a
process of its own, reaches its engine through one entry point, ``EngineCore.handle`` (logged
by ``route_probe/sitecustomize.py`` in whichever process holds the engine: single mode's
``LLMEngine`` or rank 0's ``RuntimeEngine``), once per request, and gives the same text."""
import json
import os
import subprocess
import sys

import openai
import pytest

from mpi_util import mpiexec_path
from repo_paths import MPI_PROGS
from serve_util import BIN, HYDRA_QUIET, MpiServe

PROBE = os.path.join(os.path.dirname(__file__), "route_probe")
PROMPT = [5, 6, 7, 8]
SIZES = ["scheduler.max_model_len=64", "scheduler.max_num_seqs=4",
         "scheduler.max_num_batched_tokens=32", "cache.num_blocks=64", "cache.block_size=4"]
ENGINE = {"single": "LLMEngine", "a1e2": "RuntimeEngine"}


@pytest.fixture(scope="module")
def ckpt(tiny_ckpts):
    return tiny_ckpts[("mixtral", "base")]


@pytest.fixture
def route_log(tmp_path, monkeypatch):
    """The probe on for every process started from here on (ranks of child jobs too)."""
    log = tmp_path / "route.jsonl"
    monkeypatch.setenv("MEGAINFER_ROUTE_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [PROBE, *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return log


def _entries(log) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def _llm_or_async(ckpt, deploy, face, tmp_path) -> str:
    p = subprocess.run([sys.executable, os.path.join(MPI_PROGS, "route_driver.py"), ckpt, deploy,
                        face], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _served(ckpt, deploy) -> str:
    srv = MpiServe(None, [f"deploy={deploy}", f"model.path={ckpt}", "serve.served_model_name=tiny",
                          *SIZES])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text
    finally:
        srv.close()


def _offline(ckpt, deploy, tmp_path) -> str:
    inp, out = tmp_path / f"in_{deploy}.jsonl", tmp_path / f"out_{deploy}.jsonl"
    inp.write_text(json.dumps({"id": f"route-job-{deploy}", "prompt_token_ids": PROMPT}) + "\n")
    cmd = [os.path.join(BIN, "megainfer-launch"), f"model.path={ckpt}", f"deploy={deploy}",
           f"io.input={inp}", f"io.output={out}", "io.progress=false", "sampling.max_tokens=5",
           "sampling.temperature=0", "sampling.ignore_eos=true", *SIZES, *HYDRA_QUIET]
    if deploy != "single":
        cmd = [mpiexec_path(), "-n", "3", *cmd]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text().splitlines()[0])["text"]


@pytest.mark.parametrize("deploy", ["single", "a1e2"])
def test_every_front_door_takes_the_one_route(ckpt, deploy, route_log, tmp_path):
    got, seen = {}, {}
    for face in ("llm", "async", "serve", "offline"):
        before = len(_entries(route_log))
        if face in ("llm", "async"):
            got[face] = _llm_or_async(ckpt, deploy, face, tmp_path)
        elif face == "serve":
            got[face] = _served(ckpt, deploy)
        else:
            got[face] = _offline(ckpt, deploy, tmp_path)
        seen[face] = _entries(route_log)[before:]
    for face, entries in seen.items():  # one request in: one entry, by the engine's core
        assert [(e["entry"], e["engine"]) for e in entries] == \
            [("EngineCore.handle", ENGINE[deploy])], (face, entries)
    assert len(set(got.values())) == 1 and got["llm"], got  # the same greedy text
