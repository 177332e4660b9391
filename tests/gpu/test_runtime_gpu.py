"""The disaggregated runtime and its device transports on a GPU (marked gpu: skipped without
CUDA; perf/gpu_session.sh runs them). Every rank shares the one GPU, as on the lent H200.

* cuda_ipc and staged mpi round trips, 2 and 3 ranks, both layouts (colocated: self-peers);
* mpirun -n 2 / -n 3: fp32 tokens identical to single mode on the GPU, for cuda_ipc and mpi;
  bf16 tokens identical between the two transports; host syncs of a decode step on the
  attention rank within one per (MoE layer, micro-batch) plus the engine's own; none in the
  expert ranks' compute (experts and load count);
* a traced run: the four lanes on the device clock.
mpiexec: next to the interpreter, or $MPIEXEC (the GPU image's carried MPICH).
"""
import glob
import json
import os

import pytest
import torch

import mpi_util
from conftest import FAMILIES
from repo_paths import MPI_PROGS

pytestmark = pytest.mark.gpu
HERE = MPI_PROGS


def sync_budget(moe_layers: int, m: int) -> int:
    """Host syncs one decode step may make on the attention rank: the per-(MoE layer,
    micro-batch) count copy of the rows going to each expert rank, each micro-batch's one input
    copy (counted when not pinned, as in tests/gpu/test_gpu_engine.py), the sampled tokens."""
    return moe_layers * m + m + 1


@pytest.mark.parametrize("transport", ["cuda_ipc", "mpi"])
@pytest.mark.parametrize("n", [2, 3])
def test_device_transport_round_trips(tmp_path, transport, n):
    out = tmp_path / "out.json"
    mpi_util.run_mpi(n, os.path.join(HERE, "device_roundtrip.py"), [transport, "cuda", out],
                     timeout=120)
    got = json.loads(out.read_text())
    want = {"cuda_ipc": "CudaIpcTransport", "mpi": "StagingTransport"}[transport]
    assert got["transport"] == want and got["too_large"] is True
    assert got["ok"] == 96 * (n - 1) + 96 * n * n


def _moe_layers(ckpt) -> int:
    from megainfer.config import ModelConfig
    return len(ModelConfig.from_pretrained(ckpt).moe_layers())


@pytest.mark.parametrize("n", [2, 3])
def test_tokens_on_gpu_match_single_mode_and_across_transports(tiny_ckpts, tmp_path, n):
    ckpt = tiny_ckpts[(FAMILIES[0], "base")]
    mpi_util.run_mpi(n, os.path.join(HERE, "gpu_runtime_job.py"),
                     [tmp_path, ckpt, "cuda_ipc,mpi", "float32,bfloat16", "1,2"], timeout=240)
    got = json.loads((tmp_path / "result.json").read_text())
    for t in ("cuda_ipc", "mpi"):
        for m in (1, 2):
            assert got[f"{t}|float32|m={m}"] == got["single|float32"], (t, m)
    for m in (1, 2):
        assert got[f"cuda_ipc|bfloat16|m={m}"] == got[f"mpi|bfloat16|m={m}"], m
    L = _moe_layers(ckpt)
    for m in (1, 2):  # decode steps (one token per sequence) of the cuda_ipc run
        steps = [s for s in got[f"syncs|cuda_ipc|float32|m={m}"] if s[0] and s[0] == s[1]]
        assert steps, "no decode step recorded"
        worst = max(s[2] for s in steps)
        assert worst <= sync_budget(L, m), (m, worst, L, steps)
        for calls, n in got[f"expert_syncs|cuda_ipc|float32|m={m}"]:  # expert ranks' compute
            assert calls > 0 and n == 0, (m, calls, n)


def test_tp2_replica_tokens_on_gpu_match_single_mode_over_both_tp_paths(tiny_ckpts, tmp_path):
    """Attention TP 2 + 1 expert rank on the one GPU: with cuda_ipc the TP all-reduces and
    broadcasts go point to point between the two processes (runtime/tp/channel.py), with mpi
    through host memory; fp32 tokens equal single mode's, bf16 tokens agree between the two."""
    ckpt = tiny_ckpts[(FAMILIES[0], "base")]
    mpi_util.run_mpi(3, os.path.join(HERE, "gpu_runtime_job.py"),
                     [tmp_path, ckpt, "cuda_ipc,mpi", "float32,bfloat16", "1,2", "tp2"],
                     timeout=300)
    got = json.loads((tmp_path / "result.json").read_text())
    for m in (1, 2):
        for t in ("cuda_ipc", "mpi"):
            assert got[f"{t}|float32|m={m}"] == got["single|float32"], (t, m)
        assert got[f"cuda_ipc|bfloat16|m={m}"] == got[f"mpi|bfloat16|m={m}"], m
        assert got[f"tp_sent|cuda_ipc|float32|m={m}"] > 0 and got[f"tp_sent|mpi|float32|m={m}"] == 0


def test_traced_run_has_the_four_lanes_on_the_device_clock(tiny_ckpts, tmp_path):
    ckpt = tiny_ckpts[(FAMILIES[0], "base")]
    mpi_util.run_mpi(3, os.path.join(HERE, "gpu_runtime_job.py"),
                     [tmp_path, ckpt, "cuda_ipc", "bfloat16", "2", "trace"], timeout=180)
    from megainfer.runtime.trace import merge_traces
    from megainfer.runtime.trace_metrics import pipeline_metrics
    paths = sorted(glob.glob(str(tmp_path / "trace.rank*.json")))
    assert len(paths) == 3
    merged = json.load(open(merge_traces(paths, str(tmp_path / "trace.json"))))
    lanes = {e["cat"] for e in merged["traceEvents"] if e["ph"] == "X"}
    assert lanes == {"attention", "A2E", "expert", "E2A"}
    spans = [e for e in merged["traceEvents"] if e["ph"] == "X" and e["cat"] == "attention"]
    assert all(e["dur"] > 0 for e in spans)
    m = pipeline_metrics(merged)
    assert m["T_a_us"] > 0 and m["T_e_us"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cudart_found_and_raw_memory_wraps_as_a_tensor():
    from megainfer.comm.cudart import device_tensor, runtime
    rt = runtime()
    ptr = rt.alloc(4096)
    t = device_tensor(ptr, 4096, torch.device("cuda", torch.cuda.current_device()))
    t.fill_(7)
    assert t.data_ptr() == ptr and int(t.sum()) == 7 * 4096
    ev = rt.ipc_event()
    assert len(rt.event_handle(ev)) == 64 and len(rt.mem_handle(ptr)) == 64
    rt.free(__import__("ctypes").c_void_p(ptr))
