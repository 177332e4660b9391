"""Tensor-parallel prefill replicas and ``SamplingParams.n > 1`` with prefill ranks (docs/pd.md):
the KV head routes between prefill and decode TP ranks, a decode cache assembled from several
senders' head runs, greedy tokens identical to single mode with 2P(tp=2)+1A+1E for every
family (GQA with KV heads split, one KV head replicated, the MLA latent), and seeded n=3
sampling identical to single mode (samples finishing at their first token included)."""
import dataclasses
import json
import os
import sys

import pytest
import torch

from conftest import FAMILIES
from mpi_util import run_mpi

from megainfer.kernels import kv_quant
from megainfer.runtime.pd.kv_place import place
from megainfer.models.kv_spec import kv_head_slice as head_slice
from megainfer.runtime.pd.kv_routes import check_prefill_tp, routes_to
from megainfer.runtime.pd.prefill_experts import expert_slots_of

JOB = os.path.join(os.path.dirname(__file__), "mpi_progs", "pd_job.py")
sys.path.insert(0, os.path.dirname(JOB))  # runtime_job, pd_job: the jobs' prompts


@pytest.mark.parametrize("H,src_tp,dst_tp", [(2, 2, 1), (4, 2, 4), (4, 4, 2), (2, 4, 1),
                                             (1, 2, 2), (8, 2, 4), (4, 1, 2), (2, 2, 8)])
def test_routes_cover_each_decode_slice_once_from_a_holder(H, src_tp, dst_tp):
    senders = {}
    for t in range(dst_tp):
        first, count = head_slice(H, dst_tp, t)
        heads = []
        for x in routes_to("gqa", H, src_tp, dst_tp, t):
            a, n = x.sender_heads(H, src_tp)
            held = head_slice(H, src_tp, x.src)
            assert 0 <= a and a + n <= held[1]  # the sender holds every head it sends
            heads += range(x.first, x.first + x.count)
            senders.setdefault(x.src, []).append(t)
        assert heads == list(range(first, first + count))  # in order, each once
    # every prefill rank holding a head no lower rank holds sends; replicated heads come from
    # the lowest holder only
    owners = {min(s for s in range(src_tp) if head_slice(H, src_tp, s)[0] <= g <
                  sum(head_slice(H, src_tp, s))) for g in range(H)}
    assert set(senders) == owners
    mla = routes_to("mla", H, src_tp, dst_tp, 0)
    assert len(mla) == 1 and mla[0].src == 0 and mla[0].sender_heads(H, src_tp) is None


def test_check_prefill_tp_names_the_constraint():
    assert check_prefill_tp(4, 2, False, 2) is None and check_prefill_tp(4, 1, False, 4) is None
    assert "num_heads=4" in check_prefill_tp(4, 2, False, 3)
    assert "num_kv_heads=3" in check_prefill_tp(6, 3, False, 2)
    assert check_prefill_tp(6, 6, True, 2) is None  # MLA: heads only
    assert "num_experts=2" in check_prefill_tp(4, 4, False, 4, num_experts=2)


@pytest.mark.parametrize("E,tp", [(4, 2), (6, 4), (8, 8), (5, 3)])
def test_expert_shares_cover_the_experts_once(E, tp):
    shares = [expert_slots_of(E, tp, t) for t in range(tp)]
    assert sum(shares, []) == list(range(E)) and min(map(len, shares)) >= 1


def test_cache_assembled_from_head_runs_equals_whole():
    """Two senders' runs of a decode rank's heads, placed side by side, give the cache one
    sender of every head gives; a quantised second run with other scales is requantised."""
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(2, 3, 4, 4, 8, generator=g)  # [2, n, BS, H, D]
    blocks = [5, 1, 7]
    whole, parts = torch.zeros(2, 9, 4, 4, 8), torch.zeros(2, 9, 4, 4, 8)
    place(whole, "gqa", blocks, buf, None)
    place(parts, "gqa", blocks, buf[:, :, :, :1].contiguous(), None, heads=(0, 1))
    place(parts, "gqa", blocks, buf[:, :, :, 1:].contiguous(), None, heads=(1, 3))
    assert torch.equal(whole, parts) and parts[:, blocks].abs().sum() > 0
    fmt = "fp8_e4m3"
    cache = torch.zeros(2, 9, 4, 4, 8, dtype=torch.float8_e4m3fn)
    kv_quant.register(cache)
    s0, s1 = torch.tensor([0.01, 0.02]), torch.tensor([0.015, 0.02])
    q0 = kv_quant.quantize(buf[:, :, :, :2], s0[0], fmt)  # keys' scale for both parts: close
    q1 = kv_quant.quantize(buf[:, :, :, 2:], s1[0], fmt)
    place(cache, "gqa", blocks, q0.contiguous(), s0, heads=(0, 2))
    place(cache, "gqa", blocks, q1.contiguous(), s1, heads=(2, 2))
    assert torch.equal(kv_quant.scales_of(cache), s0)  # the first sender's adopted
    got = kv_quant.dequantize(cache[:, blocks], s0[0], fmt, torch.float32)
    assert torch.equal(got[:, :, :, :2], kv_quant.dequantize(q0, s0[0], fmt, torch.float32))
    err = (got[0, :, :, 2:] - buf[0, :, :, 2:]).abs().max()
    assert 0 < err < 0.1 * buf[0].abs().max()  # requantised (fp8: a few % off), close


def _single_mode(path: str, make_inputs) -> dict:
    from runtime_job import CACHE, SCHED

    from megainfer.config import LoadConfig, ModelConfig
    from megainfer.engine.engine import LLMEngine
    from megainfer.models import build_model
    cfg = ModelConfig.from_pretrained(path)
    engine = LLMEngine.from_model(build_model(cfg, LoadConfig(path=path)), SCHED,
                                  dataclasses.replace(CACHE))
    return {o.request_id: o for o in engine.generate_stream(make_inputs(cfg.vocab_size, 12))}


def _greedy(path):
    from runtime_job import inputs
    return {k: o.outputs[0].token_ids for k, o in _single_mode(path, inputs).items()}


def test_tp2_prefill_greedy_equals_single_mode_every_gqa_family(tiny_ckpts, single_mode_tokens,
                                                                 tmp_path):
    """One prefill replica of 2 TP ranks (each computes and sends one of the two KV heads; the
    decode rank assembles both) + 1 decode attention + 1 expert rank, m=2,
    for every GQA family, and Mixtral's odd shape (one KV head: both prefill ranks hold it,
    rank 0 sends it)."""
    ckpts = [tiny_ckpts[(fam, "base")] for fam in FAMILIES] + [tiny_ckpts[("mixtral", "odd")]]
    out = tmp_path / "out.json"
    run_mpi(4, JOB, [out, 1, 1, 1, 1, "2", ",".join(ckpts), "ptp=2"], timeout=600)
    got = json.loads(out.read_text())
    for ckpt in ckpts:
        want = single_mode_tokens.get(ckpt) or _greedy(ckpt)
        assert got[f"{ckpt}|m=2"] == want, ckpt
        stats = got[f"{ckpt}|m=2|stats"]
        assert stats["handoffs"] == 7 and stats["prefilled"] == [7]


@pytest.mark.parametrize("kv,gran", [("fp8_e4m3", "tensor"), ("fp4_e2m1", "tensor"),
                                     ("fp4_e2m1", "token_head")])
def test_tp2_prefill_quantised_cache_equals_single_mode(tiny_ckpts, tmp_path, kv, gran):
    """A quantised cache under prefill TP 2. tensor scales: the TP ranks agree on each layer's
    scales from every rank's heads (models.layers.agree_kv_scales), so each sends the bytes
    single mode stores and the decode replica adopts single mode's scales. token_head: each
    row carries its own scale, the bytes are single mode's by construction. The tokens match."""
    from test_pd import _single_mode as single_mode_kv
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "out.json"
    run_mpi(4, JOB, [out, 1, 1, 1, 1, "2", ckpt, "ptp=2", f"kv={kv}", f"gran={gran}"],
            timeout=600)
    assert json.loads(out.read_text())[f"{ckpt}|m=2"] == single_mode_kv(ckpt, kv, gran=gran)


def test_tp2_prefill_collectives_over_the_device_channel_equal_single_mode(tiny_ckpts,
                                                                            single_mode_tokens,
                                                                            tmp_path):
    """comm.tp_collectives=channel: the prefill replica's all-reduces (attention, its share of
    the experts) travel point to point over the job's transport (MPI's on cpu, cuda_ipc on a
    GPU; tensors over the channel's capacity go in pieces: tests/distributed/test_tp_channel.py); tokens
    equal single mode."""
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "out.json"
    run_mpi(4, JOB, [out, 1, 1, 1, 1, "2", ckpt, "ptp=2", "tp=channel"], timeout=600)
    got = json.loads(out.read_text())
    assert got[f"{ckpt}|m=2"] == single_mode_tokens[ckpt]
    sent = got[f"{ckpt}|m=2|stats"]["tp_sent"]  # ranks: decode attention, expert, prefill x 2
    assert sent[:2] == [0, 0] and sent[2] > 0 and sent[2] == sent[3], sent


def test_tp2_prefill_mla_latent_equals_single_mode(tmp_path_factory, tmp_path):
    """DeepSeek-V3 (MLA): attention heads split over the 2 prefill TP ranks, the latent sent
    once (TP rank 0's copy)."""
    from megainfer.tools.make_tiny import make_tiny
    ckpt = make_tiny("deepseek_v3", str(tmp_path_factory.mktemp("dsv3") / "c"), seed=1)
    out = tmp_path / "out.json"
    run_mpi(4, JOB, [out, 1, 1, 1, 1, "2", ckpt, "ptp=2"], timeout=600)
    assert json.loads(out.read_text())[f"{ckpt}|m=2"] == _greedy(ckpt)


@pytest.mark.parametrize("ptp", [1, 2])
def test_n_samples_through_prefill_ranks_equal_single_mode(tiny_ckpts, tmp_path, ptp):
    """n=3 seeded samples: the prefill replica samples each sample's first token from the
    prompt's logits (single mode's fork), the decode replica runs them sharing the prompt's
    blocks. Every sample's tokens equal single mode's, including samples finished at their
    first token beside samples that go on."""
    from pd_job import sampled_inputs
    ckpt = tiny_ckpts[("mixtral", "base")]
    want = {k: [c.token_ids for c in o.outputs] for k, o in
            _single_mode(ckpt, lambda v, mt: sampled_inputs(v, mt, 3)).items()}
    assert {len(t) for t in want["r3"]} == {1}
    # the group's head finishes at its first token, the other samples go on
    assert len(want["r5"][0]) == 1 and min(map(len, want["r5"][1:])) > 1, want["r5"]
    assert len({tuple(t) for t in want["r1"]}) > 1  # the samples differ
    out = tmp_path / "out.json"
    run_mpi(2 + ptp, JOB, [out, 1, 1, 1, 1, "2", ckpt, "n=3", f"ptp={ptp}"], timeout=600)
    assert json.loads(out.read_text())[f"{ckpt}|m=2"] == want


def test_launch_tp2_prefill_replica_with_n2_equals_a1e2(tmp_path, tiny_ckpts):
    """``megainfer-launch`` with ``deploy.prefill_replicas=1 deploy.prefill_tp=2`` (ranks 2-3)
    and ``sampling.n=2`` seeded sampling: every completion of every line equals ``deploy=a1e2``'s
    (no prefill ranks), and the handed-off lines carry ``kv_handoff_s``."""
    from test_launch_mpi import LAUNCH, _launch, _lines
    ckpt = tiny_ckpts[("qwen3_moe", "base")]
    runs = {"a1e2": (3, ["deploy=a1e2"]),
            "p1tp2": (4, ["deploy.mode=disaggregated", "deploy.attention_replicas=1",
                          "deploy.expert_ranks=1", "deploy.prefill_replicas=1",
                          "deploy.prefill_tp=2"])}
    got = {}
    for name, (n, deploy) in runs.items():
        args = [f"model.path={ckpt}", *deploy, "sampling.max_tokens=6", "sampling.n=2",
                "sampling.temperature=0.8", "sampling.top_k=20", "io.progress=false",
                f"hydra.run.dir={tmp_path}/{name}"]
        p = _launch(["-n", str(n), LAUNCH, *args], tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        got[name] = {r["id"]: r for r in _lines(tmp_path / name / "generations.jsonl")}
    assert len(got["a1e2"]) == 8

    def samples(rec):
        return [o["token_ids"] for o in rec["outputs"]]
    assert all(len(samples(r)) == 2 for r in got["a1e2"].values())
    assert {k: samples(r) for k, r in got["a1e2"].items()} == \
        {k: samples(r) for k, r in got["p1tp2"].items()}
    assert all(r["kv_handoff_s"] > 0 for r in got["p1tp2"].values())


@pytest.mark.parametrize("fam,shape", [("qwen2_moe", "base"), ("mixtral", "odd")])
def test_split_experts_hold_a_share_and_sum_to_the_whole(tiny_ckpts, fam, shape):
    """Each prefill TP rank's model holds only its experts; with the all-reduce adding the other
    rank's partial sum, the MoE layer's output is the whole model's (shared expert once)."""
    from megainfer.config import LoadConfig, ModelConfig
    from megainfer.models import build_model
    from megainfer.runtime.pd.prefill_experts import SplitExpertsMLP, split_experts
    path = tiny_ckpts[(fam, shape)]
    cfg = ModelConfig.from_pretrained(path)
    whole = build_model(cfg, LoadConfig(path=path))
    shares = [build_model(cfg, LoadConfig(path=path),
                          expert_slots=[expert_slots_of(cfg.num_experts, 2, t)] * cfg.num_layers)
              for t in range(2)]
    l = cfg.moe_layers()[0]
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    parts = []
    for t, m in enumerate(shares):
        mlp = m.layers[l].mlp
        assert mlp.experts.gate_up_proj.shape[0] == len(expert_slots_of(cfg.num_experts, 2, t))
        w, ids = mlp.gate(x)
        parts.append(mlp.experts(x, w, ids))
    with torch.no_grad():
        want = whole.layers[l].mlp(x)
        for t, m in enumerate(shares):
            split_experts(m, lambda p, t=t: p + parts[1 - t])  # "all-reduce": add the other's
            assert isinstance(m.layers[l].mlp, SplitExpertsMLP)
            torch.testing.assert_close(m.layers[l].mlp(x), want, rtol=1e-5, atol=1e-6)


def test_hung_prefill_tp_peer_aborts_the_job_in_bounded_time(tiny_ckpts, tmp_path):
    """TP rank 1 of the prefill replica stops at its first step: the leader's all-reduce (or
    rank 0, hearing nothing from the replica) gives up after comm.timeout_s (3 s) naming a rank,
    and the job ends by itself."""
    import time
    ckpt = tiny_ckpts[("mixtral", "base")]
    t0 = time.process_time()
    with pytest.raises(AssertionError) as e:
        run_mpi(4, JOB, [tmp_path / "o.json", 1, 1, 1, 1, "2", ckpt, "ptp=2", "fault=hang_peer"],
                timeout=300)
    msg = str(e.value)
    assert "exited" in msg and "did not answer within" in msg, msg[-2000:]
    assert "tensor-parallel all-reduce" in msg or "prefill of request 'r" in msg, msg[-2000:]
    assert not (tmp_path / "o.json").exists()
    assert time.process_time() - t0 < 60


def test_a_late_tp_collective_names_the_rank_waited_on():
    """Followers name their leader; the leader of a pair names its follower (it used to name
    itself); a leader of three or more cannot know which peer is late and says so."""
    from megainfer.runtime.control import RankFailure
    from megainfer.runtime.tp.group import late_peer
    assert [late_peer(4, r, 2) for r in (0, 1)] == [5, 4]
    assert [late_peer(0, r, 4) for r in range(4)] == [None, 0, 0, 0]
    assert "a peer rank did not answer" in str(RankFailure("[attn dp0 tp0]", None, "x", 1.0))
