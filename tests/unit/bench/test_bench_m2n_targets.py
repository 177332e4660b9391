"""megainfer/bench/m2n_targets.check_targets (perf/bench/bench_m2n.py's targets): counts, ratios and the A/A noise envelope, on synthetic rows."""

import pytest


@pytest.fixture(scope="module")
def bench():
    from megainfer.bench import m2n_targets
    return m2n_targets


def rows(bench, cells):
    """cells: {(size, method): (p50, p99)} for 1x1 dispatch; every compared method present."""
    out = []
    for (size, method), (p50, p99) in cells.items():
        out.append(dict(M=1, N=1, direction="dispatch", method=method, size=size, count=1,
                        iters=10, p50=p50, p99=p99))
    return out


def test_counts_ratios_and_noise_envelope(bench):
    base = {"alltoallv": (10.0, 20.0), "gloo": (100.0, 200.0), "mpi-p2p": (8.0, 16.0),
            "m2n-yield": (9.0, 18.0), "m2n-flatpoll": (12.0, 24.0)}  # no m2n-spin: not run
    cells = {}
    for size, (m2n, aa) in {2048: ((11.0, 19.0), (11.5, 21.0)),     # m2n 1.10x: inside A/A's 1.15x
                            8192: ((14.0, 30.0), (10.0, 20.0)),     # m2n 1.40x: beyond it
                            32768: ((9.0, 40.0), (9.5, 19.0))}.items():  # m2n p99 2x: beyond 1.05x
        for meth, v in base.items():
            cells[(size, meth)] = v
        cells[(size, "m2n")], cells[(size, "alltoallv-again")] = m2n, aa
    t = bench.check_targets({"collectives": rows(bench, cells)})
    assert t["m2n"]["p50_le_alltoallv"] == "1/3" and t["m2n"]["p99_le_alltoallv"] == "1/3"
    assert t["mpi-p2p"]["p50_le_alltoallv"] == "3/3" and t["m2n"]["p50_below_gloo"] == "3/3"
    assert t["aa_noise_envelope"] == pytest.approx({"p50": 1.15, "p99": 1.05})
    assert t["m2n"]["p50_beyond_aa_noise"] == ["1x1 dispatch 8K"]
    assert t["m2n"]["p99_beyond_aa_noise"] == ["1x1 dispatch 8K", "1x1 dispatch 32K"]
    assert t["alltoallv-again"]["p50_beyond_aa_noise"] == []  # never beyond its own envelope
    assert t["m2n_vs_flatpoll_p50"]["1x1"]["max"] == pytest.approx(14.0 / 12.0)
    assert "m2n-spin" not in t  # a method the run did not measure is left out, not a crash
