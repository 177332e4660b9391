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


PD_JOB = os.path.join(os.path.dirname(__file__), "mpi_progs", "pd_job.py")


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_pd_quantised_tokens_equal_single_mode(tiny_ckpts, tmp_path, fmt):
    """p1a1e2: the prefill rank computes on the same stored weights as the decode pool, so the
    handed-over KV and the tokens are single mode's within the format."""
    ckpt = tiny_ckpts[("qwen3_moe", "base")]
    out = tmp_path / "pd.json"
    run_mpi(4, PD_JOB, [out, 1, 1, 2, 1, "2", ckpt, f"q={fmt}"], timeout=600)
    got = json.loads(out.read_text())
    assert got[f"{ckpt}|m=2"] == _single(ckpt, fmt)
    assert got[f"{ckpt}|m=2|stats"]["handoffs"] == 7


REPLAN_JOB = os.path.join(os.path.dirname(__file__), "mpi_progs", "replan_job.py")


def test_replan_moves_quantised_experts_in_fewer_bytes(tiny_ckpts, tmp_path):
    """Forced re-plans a1e3 -> a2e2 -> a1e3 with experts kept in int4 and fp8: tokens equal
    single mode within the format, every slot holds its expert's stored bytes and scales after
    each switch, and a moved slot takes fewer bytes than in the fp32 run by the slot ratios of
    ``test_moved_slot_bytes_per_format`` (int4 g32 5.33x, fp8 4.00x). Per slot: the placement
    follows the load counted, which may differ between formats."""
    sys.path.insert(0, os.path.dirname(REPLAN_JOB))
    import replan_job
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "replan.json"
    run_mpi(4, REPLAN_JOB, [out, ckpt, "move", "q=none,int4,fp8"], timeout=600)
    res = json.loads(out.read_text())
    per_slot = lambda rec: rec["weight_bytes"] / rec["weight_slots"]  # noqa: E731
    full = [per_slot(r) for r in res["move|none"]["records"]]
    assert len(full) == 2 and full[0] == full[1] > 0
    for fmt, ratio in (("int4", 256 / 48), ("fp8", 4 * 12288 / 12296)):
        run = res[f"move|{fmt}"]
        assert run["tokens"] == replan_job.reference(ckpt, quantization=fmt), fmt
        assert [(r["old"], r["new"]) for r in run["records"]] == [("a1e3", "a2e2"),
                                                                  ("a2e2", "a1e3")]
        assert all(ok for checks in run["checks"] for kind, ok in checks if kind == "expert")
        moved = [per_slot(r) for r in run["records"]]
        assert [f / m for f, m in zip(full, moved)] == pytest.approx([ratio, ratio], rel=1e-3)
