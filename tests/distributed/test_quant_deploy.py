"""Weights kept in fp8 / int8 / int4 (``model.quantization``) under real mpiexec: expert ranks
hold quantised experts, attention ranks quantised projections, and the greedy tokens equal
single mode's within each format (disaggregated a1e2 with 1 and 2 micro-batches, colocated,
attention TP 2 where the format's slices fall on whole groups)."""
import json
import os
import sys

import pytest

from mpi_util import run_mpi
from repo_paths import MPI_PROGS

JOB = os.path.join(os.path.dirname(__file__), "mpi_progs", "runtime_job.py")


def _single(ckpt, fmt):
    sys.path.insert(0, MPI_PROGS)
    from runtime_job import CACHE, SCHED, inputs

    from megainfer.config import LoadConfig, ModelConfig
    from megainfer.engine.engine import LLMEngine
    from megainfer.models import build_model
    cfg = ModelConfig.from_pretrained(ckpt)
    model = build_model(cfg, LoadConfig(path=ckpt, quantization=fmt, quantization_group_size=32))
    eng = LLMEngine.from_model(model, SCHED, CACHE)
    return {o.request_id: o.outputs[0].token_ids
            for o in eng.generate_stream(inputs(cfg.vocab_size, 12))}


# (attention replicas, tp, expert ranks, micro-batch counts); E = 0: colocated
CASES = [("fp8", 1, 1, 2, "1,2"), ("int8", 1, 1, 2, "1,2"), ("int4", 1, 1, 2, "1,2"),
         ("int8", 2, 1, 0, "1"), ("int4", 1, 2, 1, "1")]


@pytest.mark.parametrize("fmt,A,TP,E,ms", CASES,
                         ids=[f"{c[0]}-a{c[1]}tp{c[2]}e{c[3]}" for c in CASES])
def test_quantised_tokens_equal_single_mode(tiny_ckpts, tmp_path, fmt, A, TP, E, ms):
    ckpt = tiny_ckpts[("qwen3_moe", "base")]
    want = _single(ckpt, fmt)
    out = tmp_path / "out.json"
    run_mpi(A * TP + E, JOB, [out, A, TP, E, ms, ckpt, 12, f"q={fmt}"], timeout=600)
    got = json.loads(out.read_text())
    for m in ms.split(","):
        assert got[f"{ckpt}|m={m}"] == want, (fmt, m)


EPLB_JOB = os.path.join(os.path.dirname(__file__), "mpi_progs", "eplb_job.py")


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_eplb_moves_stored_bytes_and_scales(tiny_ckpts, tmp_path, fmt):
    """Static shuffled placement and live EPLB weight moves on quantised experts: every slot
    ends up holding its logical expert's stored bytes and scales, tokens unchanged."""
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "eplb.json"
    run_mpi(3, EPLB_JOB, [out, ckpt, fmt], timeout=600)
    res = json.loads(out.read_text())
    want = _single(ckpt, fmt)
    for run in ("static_shuffled", "live"):
        assert res[run]["tokens"] == want, run
        assert all(res[run]["weights_ok"]), run
    assert sum(res["live"]["moved"]) > 0


def test_moved_slot_bytes_per_format(tiny_ckpts):
    """A weight move carries one slot's stored bytes plus scales, fewer bytes than fp32 by:
    fp8 4 * 12288 / (12288 + 2 * 4) = 3.997 (one fp32 scale per 128 x 128 block, here
    one per weight; 3.9990 at whole blocks); int8 256 / (64 + 4) = 3.76 per 64-wide fp32 row
    (4.0 at real widths); int4 group 32: 256 / (32 + 2 * 2 * 4) = 5.33 (a scale and a zero per
    32 columns, fp32: 6.4 at group 64, 7.1 at group 128)."""
    from megainfer.config import LoadConfig, ModelConfig
    from megainfer.models import build_model
    from megainfer.runtime.eplb.rebalancer import _flat, empty_slot
    ckpt = tiny_ckpts[("mixtral", "base")]
    cfg = ModelConfig.from_pretrained(ckpt)

    def slot_bytes(fmt):
        m = build_model(cfg, LoadConfig(path=ckpt, quantization=fmt, quantization_group_size=32))
        ex = m.layers[0].mlp.experts
        buf = empty_slot(ex, 1)
        assert _flat(ex, 1).shape == buf.shape and _flat(ex, 1).dtype == buf.dtype
        return buf.numel() * buf.element_size()
    fp32 = slot_bytes(None)
    ratios = {f: fp32 / slot_bytes(f) for f in ("fp8", "int8", "int4")}
    want = {"fp8": 4 * 12288 / 12296, "int8": 256 / 68, "int4": 256 / 48}
    assert all(abs(ratios[f] - want[f]) < 1e-3 for f in want), ratios
