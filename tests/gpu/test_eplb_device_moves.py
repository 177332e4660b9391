"""Expert weight moves device to device (runtime/eplb/weight_channel.py, comm.eplb_moves): buffers
moved exactly in small messages between expert ranks, a silent peer named by its job rank, live
EPLB and a re-plan with the device path giving single mode's tokens and the checkpoint's weights
in every slot. On CPU the device path runs over the MPI transport (the stand-in, as for
comm.tp_collectives=channel); the gpu-marked tests run it over cuda_ipc on the one GPU."""
import json
import os

import pytest
import torch

import mpi_util
from repo_paths import MPI_PROGS

HERE = MPI_PROGS
CHANNEL_JOB = os.path.join(HERE, "weight_channel_job.py")
EPLB_JOB = os.path.join(HERE, "eplb_device_job.py")


def _channel_results(tmp_path, device: str) -> list[dict]:
    mpi_util.run_mpi(4, CHANNEL_JOB, [tmp_path, device], timeout=180)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (1, 2, 3)]


def _check_channel(got: list[dict]) -> None:
    for r, g in enumerate(got):
        assert g["ok"] and g["moves_in"] > 0, (r, g)
        # every byte went over the channel, in as many messages as the chunking predicts
        assert g["sent"] == g["want_sent"] > g["moves_in"] // 2, (r, g)
        assert g["received"] == g["want_received"] > 0, (r, g)
    assert sum(g["sent"] for g in got) == sum(g["received"] for g in got)


def test_weight_moves_are_exact_in_small_messages(tmp_path):
    _check_channel(_channel_results(tmp_path, "cpu"))


def test_a_silent_peer_during_a_move_is_named_by_its_job_rank(tmp_path):
    mpi_util.run_mpi(4, CHANNEL_JOB, [tmp_path, "cpu", "hang"], timeout=180)
    for r in (1, 2):  # expert indices 0, 1; the silent one is expert 2 = job rank 3
        msg = (tmp_path / f"rank{r}.err").read_text()
        assert "rank 3 did not answer" in msg and "EPLB weight move" in msg, msg


def _check_eplb(run: dict, want: dict, kind) -> None:
    assert run["tokens"] == want
    experts = run["experts"]
    assert len(experts) == 2 and all(e["kind"] == kind for e in experts), experts
    assert min(e["rebalances"] for e in experts) >= 2, experts  # forced mid-generation
    assert sum(e["moved"] for e in experts) > 0, experts
    assert all(e["weights_ok"] for e in experts), experts
    if kind is None:  # the host path sends nothing over the device path
        assert all(e["device_messages"] == 0 for e in experts), experts
    else:  # a fall-back to the host path would leave these at 0
        assert all(e["device_messages"] > 0 for e in experts), experts


def test_live_eplb_with_device_moves_keeps_tokens_and_weights(tiny_ckpts, single_mode_tokens,
                                                              tmp_path):
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "eplb.json"
    mpi_util.run_mpi(3, EPLB_JOB, [out, ckpt, "cpu", "device,mpi"], timeout=600)
    res = json.loads(out.read_text())
    _check_eplb(res["device"], single_mode_tokens[ckpt], "mpi")  # the MPI transport: cpu stand-in
    _check_eplb(res["mpi"], single_mode_tokens[ckpt], None)


def test_replan_with_device_moves_keeps_tokens_and_weights(tiny_ckpts, tmp_path):
    """a1e3 -> a2e2 -> a1e3 (requests recomputed, live EPLB in between): the re-plan's weights
    and the rebalances' go over the device path, tokens equal single mode's, every slot holds
    its checkpoint weights after each switch."""
    import sys
    sys.path.insert(0, HERE)
    import replan_job
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "replan.json"
    mpi_util.run_mpi(4, os.path.join(HERE, "replan_device_job.py"), [out, ckpt], timeout=600)
    res = json.loads(out.read_text())
    assert res["tokens"] == replan_job.reference(ckpt)
    recs = res["records"]
    assert [(r["old"], r["new"]) for r in recs] == [("a1e3", "a2e2"), ("a2e2", "a1e3")]
    assert all(r["weight_bytes"] > 0 for r in recs)
    for rank in (1, 2, 3):
        assert all(ok for kind, ok in res["checks"][rank] if kind == "expert"), res["checks"]
        assert res["final"][rank][:2] == ["expert", True]
    # rank 1 (expert -> attention -> expert) takes its slots back at the second switch, from
    # the device path; rank 3 sends some of them (it held experts throughout)
    replan = "re-plan expert weight move"
    assert sum(s.get(replan, 0) for s in res["sent"]) > 0, res["sent"]
    assert res["sent"][0].get(replan, 0) == 0  # rank 0 never held experts
    assert min(f[2] for f in res["final"][1:]) >= 1  # live EPLB ran too
    assert sum(s.get("EPLB weight move", 0) for s in res["sent"]) > 0, res["sent"]


def test_eplb_moves_choice():
    from megainfer.config import CommConfig, ConfigError
    from megainfer.runtime.eplb.weight_channel import CHUNK_BYTES, eplb_moves_kind, n_chunks
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert eplb_moves_kind("auto", cpu, "auto") is None  # cpu: host MPI
    assert eplb_moves_kind("auto", cuda, "auto") == "cuda_ipc"
    assert eplb_moves_kind("auto", cuda, "cuda_ipc") == "cuda_ipc"
    assert eplb_moves_kind("auto", cuda, "nccl") is None
    assert eplb_moves_kind("auto", cuda, "mpi") is None
    assert eplb_moves_kind("device", cpu, "auto") == "mpi"  # the stand-in the tests run
    assert eplb_moves_kind("device", cuda, "mpi") == "cuda_ipc"
    assert eplb_moves_kind("mpi", cuda, "cuda_ipc") is None
    assert CommConfig().eplb_moves == "auto"
    with pytest.raises(ConfigError, match="comm.eplb_moves"):
        CommConfig(eplb_moves="nccl")
    from hydra import compose, initialize_config_module

    from megainfer.engine.job_doors import settings_from_config
    for value in ("device", "bogus"):  # the launcher's path: conf/config.yaml + an override
        with initialize_config_module(config_module="megainfer.conf", version_base=None):
            cfg = compose("config", overrides=[f"comm.eplb_moves={value}"])
        if value == "device":
            assert settings_from_config(cfg, 1).comm.eplb_moves == "device"
        else:
            with pytest.raises(ConfigError, match="comm.eplb_moves"):
                settings_from_config(cfg, 1)
    # DeepSeek-V3's routed expert in bf16: 3 * 7168 * 2048 elements = 84 MiB -> 11 messages
    per_message = CHUNK_BYTES // 2
    assert n_chunks(3 * 7168 * 2048, per_message) == 11
    assert n_chunks(1, per_message) == 1 and n_chunks(per_message, per_message) == 1


@pytest.mark.gpu
def test_weight_moves_over_cuda_ipc_are_exact(tmp_path):
    _check_channel(_channel_results(tmp_path, "cuda"))


@pytest.mark.gpu
def test_live_eplb_over_cuda_ipc_keeps_tokens_and_weights(tiny_ckpts, tmp_path):
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "eplb.json"
    mpi_util.run_mpi(3, EPLB_JOB, [out, ckpt, "cuda", "device,mpi,auto"], timeout=300)
    res = json.loads(out.read_text())
    _check_eplb(res["device"], res["single"], "cuda_ipc")
    _check_eplb(res["auto"], res["single"], "cuda_ipc")  # auto on cuda: the device path
    _check_eplb(res["mpi"], res["single"], None)
