"""perf/bench_m2n_ladder: its summary on synthetic rows, and every rung run for real under
mpiexec (2x2, one size, few iterations): the inline rung checks the channel's headers, so a
change to the channel's internals that breaks it fails here."""
import json
import os

import pytest
from mpi_util import run_mpi
from perf_util import PERF, import_perf


def _rows(cells):
    """cells: {method: (p50, cpu)} for one 2x2 dispatch 2 KiB cell."""
    return [dict(M=2, N=2, direction="dispatch", size=2048, method=m, iters=10, p50=p50,
                 p99=p50, cpu_max=cpu) for m, (p50, cpu) in cells.items()]


def test_summary_ratios_against_alltoallv():
    ladder = import_perf("bench_m2n_ladder")
    got = ladder.summarize(_rows({"alltoallv": (10.0, 4.0), "alltoallv-again": (10.5, 4.0),
                                  "mpi-p2p": (9.0, 3.0), "lean": (8.0, 2.0),
                                  "inline": (10.0, 4.4), "m2n": (14.0, 6.0)}))
    assert got["m2n"]["p50_vs_alltoallv_median"] == pytest.approx(1.4)
    assert got["m2n"]["cpu_vs_alltoallv_median"] == pytest.approx(1.5)
    assert got["m2n"]["p50_le_alltoallv"] == "0/1" and got["inline"]["p50_le_alltoallv"] == "1/1"
    assert got["lean"]["p50_vs_alltoallv_max"] == pytest.approx(0.8)


def test_every_rung_runs_under_mpiexec(tmp_path):
    out = tmp_path / "ladder.json"
    run_mpi(4, os.path.join(PERF, "bench_m2n_ladder_mpi.py"),
            ["--out", out, "--sizes", "2048", "--configs", "2x2", "--scale", "0.01"], timeout=180)
    res = json.loads(out.read_text())
    rows = res["collectives"]
    assert {r["method"] for r in rows} == set(res["methods"])
    assert {r["direction"] for r in rows} == {"dispatch", "combine"}
    assert all(r["iters"] == 10 and 0 < r["p50"] <= r["p99"] and r["cpu_max"] > 0 for r in rows)
