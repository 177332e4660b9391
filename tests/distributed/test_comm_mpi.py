"""M2N / N2M over real mpiexec processes: one 4-rank launch runs every MxN config (sub-
communicators), a second shows a corrupted payload is caught. See mpi_progs/comm_roundtrip.py."""
import os
import re

import pytest

from mpi_util import run_mpi

PROG = os.path.join(os.path.dirname(__file__), "mpi_progs", "comm_roundtrip.py")
# MxN:iters:layers:micro_batches:streams:depth:hidden:capacity
CONFIGS = {
    "1x1": "1x1:100:2:3:1:3:256:128",   # up to 128 KiB messages (MPICH rendezvous), one tag
    "1x2": "1x2:100:2:3:3:1:8:16",      # a tag per micro-batch, ring depth 1
    "2x1": "2x1:100:2:3:3:2:8:16",
    "2x2": "2x2:100:2:3:1:2:8:16",      # 3 micro-batches in flight on one tag, depth 2
    "1x3": "1x3:100:2:3:3:2:8:16",
}


@pytest.fixture(scope="module")
def results():
    proc = run_mpi(4, PROG, list(CONFIGS.values()) + ["timeout"], timeout=240)
    return {m.group(1): m.group(2) for m in re.finditer(r"^RESULT (\S+) OK (.*)$", proc.stdout, re.M)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_m2n_roundtrip(results, name):
    cfg = CONFIGS[name]
    assert cfg in results, f"{name}: no RESULT line; got {list(results)}"
    M, N = map(int, name.split("x"))
    msgs = int(re.search(r"'msgs': (\d+)", results[cfg]).group(1))
    checked = int(re.search(r"'checked': (\d+)", results[cfg]).group(1))
    empty = int(re.search(r"'empty': (\d+)", results[cfg]).group(1))
    assert msgs == 100 * 2 * 3 * M * N          # every (it, layer, mb, a, e) sent once
    assert checked == 2 * msgs                  # verified on both legs
    assert 0 < empty < msgs                     # empty messages were exercised
    if name == "1x1":  # 0..128 rows: more sizes than a slot keeps persistent sends for
        assert int(re.search(r"'isend_fallback': (\d+)", results[cfg]).group(1)) > 0


def test_timeout_names_peer_layer_microbatch(results):
    assert "timeout" in results, list(results)
    assert "'waited'" in results["timeout"]


def test_corrupted_payload_is_caught():
    os.environ["COMM_TEST_CORRUPT"] = "1"
    try:
        with pytest.raises(AssertionError) as info:
            run_mpi(2, PROG, ["1x1:5:1:2:1:2:8:16"], timeout=120)
    finally:
        del os.environ["COMM_TEST_CORRUPT"]
    # read from the rank's error file, which survives MPI_Abort (its stderr may not)
    reports = str(info.value).split("--- rank errors ---\n")[1].split("--- stdout tail ---")[0]
    assert re.search(r"^rank 0: Traceback", reports, re.M), str(info.value)
    assert re.search("combine payload from 1 differs|combine crc", reports), str(info.value)
