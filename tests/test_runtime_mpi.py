"""Disaggregated and colocated runs under real mpiexec give single mode's greedy tokens, for
every family, rank layout and micro-batch count (docs/design_rules.md)."""
import json
import os

import pytest

from conftest import FAMILIES
from mpi_util import run_mpi

JOB = os.path.join(os.path.dirname(__file__), "mpi_progs", "runtime_job.py")


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
