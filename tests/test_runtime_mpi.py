"""Disaggregated and colocated runs under real mpiexec give single mode's greedy tokens, for
every family, rank layout and micro-batch count (DESIGN §3)."""
import json
import os
import sys

import pytest

from conftest import FAMILIES
from mpi_util import run_mpi

HERE = os.path.dirname(__file__)
JOB = os.path.join(HERE, "mpi_progs", "runtime_job.py")
sys.path.insert(0, os.path.join(HERE, "mpi_progs"))


@pytest.fixture(scope="session")
def single_mode_tokens(tiny_ckpts):
    """{ckpt: {request id: tokens}} from deploy.mode=single, in process."""
    from runtime_job import CACHE, SCHED, inputs

    from megainfer.config import LoadConfig, ModelConfig
    from megainfer.engine.engine import LLMEngine
    from megainfer.models import build_model
    out = {}
    for fam in FAMILIES:
        path = tiny_ckpts[(fam, "base")]
        cfg = ModelConfig.from_pretrained(path)
        engine = LLMEngine.from_model(build_model(cfg, LoadConfig(path=path)), SCHED, CACHE)
        out[path] = {o.request_id: o.outputs[0].token_ids
                     for o in engine.generate_stream(inputs(cfg.vocab_size, 12))}
    return out


LAYOUTS = [  # (attention replicas, tp, expert ranks); E = 0: colocated over A ranks
    (1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 1), (2, 1, 0), (3, 1, 0)]


@pytest.mark.parametrize("A,TP,E", LAYOUTS, ids=[f"a{a}tp{t}e{e}" for a, t, e in LAYOUTS])
def test_greedy_tokens_equal_single_mode(tiny_ckpts, single_mode_tokens, tmp_path, A, TP, E):
    ckpts = [tiny_ckpts[(fam, "base")] for fam in FAMILIES]
    ms = "1,2,3" if E else "1,2"
    out = tmp_path / "out.json"
    run_mpi(A * TP + E, JOB, [out, A, TP, E, ms, ",".join(ckpts)], timeout=600)
    got = json.loads(out.read_text())
    for ckpt in ckpts:
        for m in ms.split(","):
            assert got[f"{ckpt}|m={m}"] == single_mode_tokens[ckpt], (ckpt, m)
