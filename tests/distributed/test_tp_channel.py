"""Tensor-parallel collectives point to point (runtime/tp_channel.py, comm.tp_collectives):
the sum every rank holds is the same bits on every rank and equals the partials added in
TP-rank order; a silent TP peer is named; a replica with TP 2 over the channel gives single
mode's greedy tokens."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAMILIES
from mpi_util import run_mpi

HERE = os.path.dirname(__file__)
JOB = os.path.join(HERE, "mpi_progs", "tp_channel_job.py")
RUNTIME_JOB = os.path.join(HERE, "mpi_progs", "runtime_job.py")
H, CAP = 24, 5


def _part(rank, rows, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(rows, H, generator=g) * 10).to(dtype)


def _sum(n, rows, dtype):
    total = _part(0, rows, dtype).float()
    for r in range(1, n):
        total = total + _part(r, rows, dtype).float()
    return total.to(dtype)


@pytest.mark.parametrize("n", [2, 3])
def test_all_reduce_and_broadcast_are_exact_on_every_rank(tmp_path, n):
    run_mpi(n, JOB, [tmp_path], timeout=120)
    got = [load_file(str(tmp_path / f"rank{r}.pt")) for r in range(n)]
    for r in range(n):
        assert torch.equal(got[r]["ar32"], _sum(n, 4, torch.float32)), r
        assert got[r]["ar16"].dtype == torch.bfloat16
        assert torch.equal(got[r]["ar16"], _sum(n, CAP, torch.bfloat16)), r
        assert torch.equal(got[r]["bcast"], _part(0, 2, torch.float32)), r
        assert got[r]["empty"].shape == (0, H)
        assert torch.equal(got[r]["big"], _sum(n, CAP + 3, torch.float32)), r  # in pieces
        assert torch.equal(got[r]["bigcast"], _part(0, 2 * CAP + 1, torch.float32)), r
        assert got[r]["amax"].tolist() == [n * (n + 1) / 2] * 2  # host path
        # fp32: ar32, bcast, empty, big (2 pieces), bigcast (3 pieces); bf16: ar16
        assert got[r]["sent"].tolist() == [8, 1], r


def test_a_silent_tp_peer_is_named(tmp_path):
    run_mpi(3, JOB, [tmp_path, "hang"], timeout=120)
    for r in (0, 1):
        msg = (tmp_path / f"rank{r}.err").read_text()
        assert "rank 2 did not answer" in msg and "tensor-parallel all-reduce" in msg, msg


def test_tp2_replica_over_the_channel_equals_single_mode(tiny_ckpts, single_mode_tokens,
                                                         tmp_path):
    ckpts = [tiny_ckpts[(fam, "base")] for fam in FAMILIES]
    out = tmp_path / "out.json"
    run_mpi(3, RUNTIME_JOB, [out, 1, 2, 1, "1,2", ",".join(ckpts), 12, "tp=channel"], timeout=600)
    got = json.loads(out.read_text())
    for ckpt in ckpts:
        for m in (1, 2):
            assert got[f"{ckpt}|m={m}"] == single_mode_tokens[ckpt], (ckpt, m)
            assert got[f"{ckpt}|m={m}|tp_sent"] > 0, (ckpt, m)  # the channel carried them


def test_tp_collectives_choice():
    from megainfer.config import CommConfig, ConfigError
    from megainfer.runtime.tp_channel import tp_capacity, tp_collectives_kind
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert tp_collectives_kind("auto", cpu, "auto") is None  # cpu: MPI collectives
    assert tp_collectives_kind("auto", cuda, "auto") == "cuda_ipc"
    assert tp_collectives_kind("auto", cuda, "nccl") is None
    assert tp_collectives_kind("auto", cuda, "mpi") is None
    assert tp_collectives_kind("channel", cpu, "auto") == "mpi"
    assert tp_collectives_kind("channel", cuda, "mpi") == "cuda_ipc"
    assert tp_collectives_kind("mpi", cuda, "cuda_ipc") is None
    assert tp_capacity(7168, torch.bfloat16) == 585  # 8 MiB of bf16 rows of 7168
    with pytest.raises(ConfigError, match="comm.tp_collectives"):
        CommConfig(tp_collectives="nccl")
