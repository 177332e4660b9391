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


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp4_e2m1"])
def test_tp2_quantised_cache_equals_single_mode(tiny_ckpts, tmp_path, kv):
    """Attention TP 2 over a cache with per-layer scales (cache.kv_scale_granularity=tensor):
    each TP rank holds one of the two KV heads, and the ranks agree on each layer's scales from
    both heads (models.layers.agree_kv_scales), so they store the bytes single mode stores: the
    tokens match single mode's. (m = 1: with two micro-batches a layer's scales come from the
    first micro-batch's tokens, not the whole step's, so tensor scales are not micro-batch
    invariant: docs/kv_cache.md.)"""
    from test_pd import _single_mode as single_mode_kv
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "out.json"
    run_mpi(3, JOB, [out, 1, 2, 1, "1", ckpt, 12, f"kv={kv}:tensor"], timeout=600)
    assert json.loads(out.read_text())[f"{ckpt}|m=1"] == single_mode_kv(ckpt, kv, gran="tensor")


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp4_e2m1"])
def test_token_head_quantised_cache_equals_single_mode_any_m_and_tp(tiny_ckpts, tmp_path, kv):
    """Per-(token, KV head) scales stored inline (cache.kv_scale_granularity=token_head, the
    default): a row's bytes depend on that row only, so disaggregated runs with 2 micro-batches,
    and attention TP 2 with 1 and 2 micro-batches, store single mode's bytes and give its
    greedy tokens (with tensor scales, m = 2 does not: docs/kv_cache.md)."""
    from test_pd import _single_mode as single_mode_kv
    ckpt = tiny_ckpts[("mixtral", "base")]
    want = single_mode_kv(ckpt, kv, gran="token_head")
    for TP, ms in ((1, "2"), (2, "1,2")):
        out = tmp_path / f"tp{TP}.json"
        run_mpi(TP + 1, JOB, [out, 1, TP, 1, ms, ckpt, 12, f"kv={kv}:token_head"], timeout=600)
        got = json.loads(out.read_text())
        for m in ms.split(","):
            assert got[f"{ckpt}|m={m}"] == want, (TP, m)
