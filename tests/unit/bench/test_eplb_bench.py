"""perf/bench/bench_eplb.py runs end to end on the tiny case and writes its JSON."""
import json
import os

from perf_util import run_perf


def test_bench_tiny_case(tmp_path):
    out = tmp_path / "eplb.json"
    stdout = run_perf("bench/bench_eplb.py", ["--cases", "tiny", "--repeats", "1", "--window", "2",
                                              "--eval-iters", "2", "--zipf", "1.5", "--out", out])
    d = json.loads(out.read_text())
    assert d["runtime"] is None and d["machine"]["cpu_count"] == os.cpu_count()
    rows = d["algorithm"]
    assert {(r["replicas"], r["policy"]) for r in rows} == {(8, "hierarchical"), (8, "global"),
                                                           (10, "hierarchical"), (10, "global")}
    for r in rows:  # on the window it was fitted to, rebalancing never loses to identity
        assert (r["window_rebalanced_max_over_mean"]["worst_layer"]
                <= r["window_identity_max_over_mean"]["worst_layer"] + 1e-9)
        assert r["algorithm_seconds_median"] > 0
    assert "identity" in stdout
