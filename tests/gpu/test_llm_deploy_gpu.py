"""``LLM(deploy=...)`` and ``AsyncLLM(deploy=...)`` on the GPU (marked gpu: skipped without one;
perf/gpu_session.sh's ``pyapi`` step): mpiexec -n 3 a1e2 with every rank on the one GPU and
cuda_ipc between them, fp32, against single mode on the same GPU: the same greedy and seeded
tokens; AsyncLLM's streams and aborts as on CPU (tests/distributed/test_llm_deploy.py)."""
import json
import os
import sys

import pytest

import mpi_util
from repo_paths import MPI_PROGS

sys.path.insert(0, MPI_PROGS)
from test_llm_deploy import _check_streams, _single  # noqa: E402

pytestmark = pytest.mark.gpu
JOB = os.path.join(MPI_PROGS, "llm_deploy_job.py")
ON_GPU = ["deploy.device=cuda", "model.dtype=float32", "comm.transport=cuda_ipc"]


@pytest.mark.parametrize("what", ["offline", "async"])
def test_a1e2_on_the_gpu_equals_single_mode(tiny_ckpts, tmp_path, what):
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "out.json"
    mpi_util.run_mpi(3, JOB, [out, ckpt, "a1e2", what, *ON_GPU], timeout=300)
    got = json.loads(out.read_text())
    want = _single(ckpt, what, device="cuda", dtype="float32")
    if what == "offline":
        assert got["greedy"] == want["greedy"] and got["seeded"] == want["seeded"]
    else:
        _check_streams(got, want)
