"""EPLB in the running system (real mpiexec): placements and live weight moves change nothing
in the greedy tokens, and every slot ends up holding its logical expert's weights."""
import json
import os

from mpi_util import run_mpi

JOB = os.path.join(os.path.dirname(__file__), "mpi_progs", "eplb_job.py")


def test_static_and_live_placements_keep_tokens(tiny_ckpts, single_mode_tokens, tmp_path):
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "eplb.json"
    run_mpi(3, JOB, [out, ckpt], timeout=600)
    res = json.loads(out.read_text())
    want = single_mode_tokens[ckpt]
    static, live = res["static_shuffled"], res["live"]
    assert static["tokens"] == want
    assert static["rebalances"] == [0, 0] and all(static["weights_ok"])
    assert sorted(set(x for row in static["phy2log"] for x in row)) == [0, 1, 2, 3]
    assert live["tokens"] == want
    assert min(live["rebalances"]) >= 2  # forced mid-generation, more than once
    assert sum(live["moved"]) > 0  # weights really moved between ranks/slots
    assert all(live["weights_ok"])
