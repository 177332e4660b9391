"""Decode attention offloaded to the prefill ranks (``pd.offload``, docs/pd.md) under real
mpiexec: greedy tokens identical to single mode for offload ratios 0, 0.5 and 1 in p1a1e2 at
m=1 and m=2 (Mixtral- and Qwen3-MoE-shaped), with two prefill ranks, with a decode pool small
enough to preempt; every block freed on both sides; online streams and aborts; a prefill rank
that stops answering offloaded attention ends the job naming it. The pieces in one process:
tests/unit/runtime/test_offload_parts.py."""
import json
import os

import pytest

from mpi_util import run_mpi

JOB = os.path.join(os.path.dirname(__file__), "mpi_progs", "pd_job.py")
LLM_JOB = os.path.join(os.path.dirname(__file__), "mpi_progs", "llm_deploy_job.py")


def _check_freed(offload: list) -> None:
    """Every rank's pool back to empty: the decode engine's blocks, the prefill pools'."""
    for rank in offload:
        if rank:
            assert rank["free"] == rank["blocks"], offload
            assert rank.get("held", 0) == 0 and rank.get("offloaded", 0) == 0, offload


def test_offload_ratios_give_single_mode_tokens_p1a1e2(tiny_ckpts, single_mode_tokens, tmp_path):
    ckpts = [tiny_ckpts[(fam, "base")] for fam in ("mixtral", "qwen3_moe")]
    out = tmp_path / "out.json"
    p = run_mpi(4, JOB, [out, 1, 1, 2, 1, "1,2", ",".join(ckpts), "offload=0,0.5,1"],
                timeout=600)
    assert "still hold blocks" not in p.stderr
    got = json.loads(out.read_text())
    for ckpt in ckpts:
        for m in (1, 2):
            for ratio, chosen in (("0", 0), ("0.5", 3), ("1", 7)):  # of the 7 requests
                key = f"{ckpt}|m={m}|off={ratio}"
                assert got[key] == single_mode_tokens[ckpt], key
                decode, _, _, prefill = got[f"{key}|stats"]["offload"]
                assert decode["chosen"] == decode["started"] == prefill["kept"] == chosen, key
                # one message per layer per micro-batch holding offloaded rows, each answered
                assert (decode["trips"] == prefill["served"]) and (decode["trips"] > 0) == (
                    chosen > 0), key
                _check_freed(got[f"{key}|stats"]["offload"])


def test_offload_over_two_prefill_ranks(tiny_ckpts, single_mode_tokens, tmp_path):
    ckpt = tiny_ckpts[("qwen3_moe", "base")]
    out = tmp_path / "out.json"
    run_mpi(4, JOB, [out, 1, 1, 1, 2, "2", ckpt, "offload=1"], timeout=600)
    got = json.loads(out.read_text())
    assert got[f"{ckpt}|m=2|off=1"] == single_mode_tokens[ckpt]
    stats = got[f"{ckpt}|m=2|off=1|stats"]
    decode, _, p0, p1 = stats["offload"]
    assert decode["started"] == 7 and p0["kept"] > 0 and p1["kept"] > 0
    assert p0["kept"] + p1["kept"] == 7 and p0["served"] + p1["served"] == decode["trips"]
    _check_freed(stats["offload"])


def test_offload_with_attention_tp_2(tiny_ckpts, single_mode_tokens, tmp_path):
    """Decode TP 2, one prefill rank: each decode TP rank sends its heads' q/k/v, the prefill
    rank keeps one head slice per decode TP rank (the same split) and attends it."""
    ckpts = [tiny_ckpts[(fam, "base")] for fam in ("mixtral", "qwen3_moe")]
    out = tmp_path / "out.json"
    run_mpi(4, JOB, [out, 1, 2, 1, 1, "2", ",".join(ckpts), "offload=1"], timeout=600)
    got = json.loads(out.read_text())
    for ckpt in ckpts:
        assert got[f"{ckpt}|m=2|off=1"] == single_mode_tokens[ckpt], ckpt
        stats = got[f"{ckpt}|m=2|off=1|stats"]
        t0, t1, _, prefill = stats["offload"]
        assert t0["started"] == t1["started"] == 7 and prefill["served"] == t0["trips"] + t1["trips"]
        _check_freed(stats["offload"])


def test_offload_deepseek_v3_mla(tmp_path_factory, tmp_path):
    """MLA: the prefill rank keeps the latent cache; q_nope, q_pe and the new latent cross per
    layer, the attention output comes back; single mode's tokens at ratios 0.5 and 1, m=1, 2."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_pd import _single_mode
    from megainfer.tools.make_tiny import make_tiny
    ckpt = make_tiny("deepseek_v3", str(tmp_path_factory.mktemp("dsv3") / "c"), seed=1)
    out = tmp_path / "out.json"
    run_mpi(4, JOB, [out, 1, 1, 2, 1, "1,2", ckpt, "offload=0.5,1"], timeout=600)
    got = json.loads(out.read_text())
    want = _single_mode(ckpt, "auto")
    for m in (1, 2):
        for ratio, chosen in (("0.5", 3), ("1", 7)):
            key = f"{ckpt}|m={m}|off={ratio}"
            assert got[key] == want, key
            assert got[f"{key}|stats"]["offload"][0]["started"] == chosen, key
            _check_freed(got[f"{key}|stats"]["offload"])


def test_offload_seeded_sampling_equals_single_mode(tiny_ckpts, tmp_path):
    """Seeded sampling (n=1: offloaded; r3 and r5 finish at their first token, so their pool
    room comes back at once): every token single mode's, the seed travels."""
    import sys
    sys.path.insert(0, os.path.dirname(JOB))
    from pd_job import sampled_inputs
    from test_pd_tp import _single_mode
    ckpt = tiny_ckpts[("mixtral", "base")]
    want = {k: [c.token_ids for c in o.outputs] for k, o in
            _single_mode(ckpt, lambda v, mt: sampled_inputs(v, mt, 1)).items()}
    out = tmp_path / "out.json"
    run_mpi(4, JOB, [out, 1, 1, 2, 1, "2", ckpt, "n=1", "offload=1"], timeout=600)
    got = json.loads(out.read_text())
    assert got[f"{ckpt}|m=2|off=1"] == want
    stats = got[f"{ckpt}|m=2|off=1|stats"]
    assert stats["offload"][0]["chosen"] == 7 and stats["offload"][0]["started"] >= 5, stats
    _check_freed(stats["offload"])


def test_offload_relieves_a_small_decode_pool(tiny_ckpts, single_mode_tokens, tmp_path):
    """34 decode blocks preempt without offload; a 17-block offload pool takes the requests
    it has room for (the others stream their KV as usual) and the preemptions go; same tokens."""
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "out.json"
    run_mpi(3, JOB, [out, 1, 1, 1, 1, "2", ckpt, "offload=0,1", "blocks=34", "mml=64",
                     "pool=17"], timeout=600)
    got = json.loads(out.read_text())
    plain, off = got[f"{ckpt}|m=2|off=0|stats"], got[f"{ckpt}|m=2|off=1|stats"]
    for ratio in ("0", "1"):
        assert got[f"{ckpt}|m=2|off={ratio}"] == single_mode_tokens[ckpt], ratio
    assert plain["preemptions"] > 0 and off["preemptions"] < plain["preemptions"], (plain, off)
    assert 0 < off["offload"][0]["started"] < 7  # the pool's room, not the ratio, limited it
    _check_freed(off["offload"])


def test_offload_auto_gives_single_mode_tokens_and_offloads_only_under_pressure(
        tiny_ckpts, single_mode_tokens, tmp_path):
    """``pd.offload_policy=auto`` on the small decode pool (34 blocks of 4 tokens, lives of up
    to 64 tokens with max_model_len 64): greedy tokens identical to single mode; the requests
    the decode KV would not hold beside the local ones are offloaded while the 17-block pool has
    room (rank 0's ledger, offload_rule.picks_auto), the others stay local; every block freed.
    With room for every request locally (the default 256 blocks), auto offloads none."""
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "out.json"
    run_mpi(3, JOB, [out, 1, 1, 1, 1, "2", ckpt, "offload=auto", "blocks=34", "mml=64",
                     "pool=17"], timeout=600)
    got = json.loads(out.read_text())
    assert got[f"{ckpt}|m=2|off=auto"] == single_mode_tokens[ckpt]
    off = got[f"{ckpt}|m=2|off=auto|stats"]
    decode = off["offload"][0]
    assert 0 < decode["chosen"] == decode["started"] < 7, off  # pressure and pool room chose
    _check_freed(off["offload"])
    out2 = tmp_path / "out2.json"
    run_mpi(3, JOB, [out2, 1, 1, 1, 1, "2", ckpt, "offload=auto"], timeout=600)
    got2 = json.loads(out2.read_text())
    assert got2[f"{ckpt}|m=2|off=auto"] == single_mode_tokens[ckpt]
    assert got2[f"{ckpt}|m=2|off=auto|stats"]["offload"][0]["chosen"] == 0  # no pressure


def test_offload_with_prefix_caching_on_the_prefill_rank(tiny_ckpts, tmp_path):
    """Shared-prefix prompts, prefix caching on: offloaded requests whose prompts hit the
    prefill rank's cache keep (a copy of) those blocks; single mode's tokens (caching off)."""
    import sys
    sys.path.insert(0, os.path.dirname(JOB))
    from runtime_job import shared_reference
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "out.json"
    run_mpi(4, JOB, [out, 1, 1, 2, 1, "2", ckpt, "offload=1", "prompts=shared", "mml=64",
                     "pool=60"], timeout=600)
    got = json.loads(out.read_text())
    want, _ = shared_reference(ckpt)
    assert got[f"{ckpt}|m=2|off=1"] == want
    stats = got[f"{ckpt}|m=2|off=1|stats"]
    assert stats["cached"] > 0 and stats["offload"][0]["started"] >= 5, stats
    _check_freed(stats["offload"])


def test_offload_online_streams_and_aborts(tiny_ckpts, tmp_path):
    """AsyncLLM over p1a1e2 with pd.offload: streams, aborts (before, at and after the first
    token) end as without offload, rank 0's engine and the prefill pool's ledger all back."""
    from test_llm_deploy import _check_streams, _single
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "out.json"
    p = run_mpi(4, LLM_JOB, [out, ckpt, "p1a1e2", "async", "pd.offload=true"], timeout=400)
    assert "still hold blocks" not in p.stderr
    got = json.loads(out.read_text())
    offloaded, room_back, _ = got["offload"]
    assert offloaded >= 7 and room_back, got["offload"]
    _check_streams(got, _single(ckpt, "async"))


def test_offload_online_requests_come_home_mid_stream(tiny_ckpts, tmp_path):
    """AsyncLLM over p1a1e2, a 24-block pool (a few requests' lives): streams arriving while
    others decode find the pool short and send decoding ones home, mid-stream; every stream and
    abort ends as single mode's, the pool's room all back."""
    from test_llm_deploy import _check_streams, _single
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / "out.json"
    p = run_mpi(4, LLM_JOB, [out, ckpt, "p1a1e2", "async", "pd.offload=true",
                             "pd.offload_blocks=24"], timeout=400)
    assert "still hold blocks" not in p.stderr
    got = json.loads(out.read_text())
    offloaded, room_back, sent_home = got["offload"]
    assert room_back and sent_home >= 1 and offloaded > sent_home, got["offload"]
    _check_streams(got, _single(ckpt, "async"))


def _greedy(path: str, max_tokens: int, first: int) -> dict:
    """Single mode's greedy tokens of runtime_job's prompts at ``max_tokens`` (the first
    request ``first``)."""
    import sys
    sys.path.insert(0, os.path.dirname(JOB))
    from runtime_job import CACHE, SCHED, inputs
    from megainfer.config import LoadConfig, ModelConfig
    from megainfer.engine.engine import LLMEngine
    from megainfer.models import build_model
    cfg = ModelConfig.from_pretrained(path)
    engine = LLMEngine.from_model(build_model(cfg, LoadConfig(path=path)), SCHED, CACHE)
    return {o.request_id: o.outputs[0].token_ids
            for o in engine.generate_stream(inputs(cfg.vocab_size, max_tokens, first))}


@pytest.mark.parametrize("fam,tp", [("mixtral", 1), ("qwen3_moe", 2), ("deepseek_v3", 1)])
def test_offloaded_requests_come_home_for_the_room(tiny_ckpts, tmp_path_factory, tmp_path, fam,
                                                   tp):
    """Two seats per decode replica, a 30-block pool of 4-token blocks: r0 (3 + 100 tokens,
    26 blocks) is offloaded, r1 (40 + 24) finds the pool short while r0 is not decoding yet
    and streams its KV; r1 done, r2 (9 + 24) finds it short again with r0 decoding, so r0
    comes home (its KV sent from the pool into the decode replica's blocks through the KV
    stream, every decode TP rank its own heads) and r2 is offloaded; greedy tokens identical to
    single mode, every block freed on both sides. DeepSeek-V3: the latent cache comes home."""
    if fam == "deepseek_v3":
        from megainfer.tools.make_tiny import make_tiny
        ckpt = make_tiny("deepseek_v3", str(tmp_path_factory.mktemp("dsv3") / "c"), seed=1)
    else:
        ckpt = tiny_ckpts[(fam, "base")]
    out = tmp_path / "out.json"
    run_mpi(4, JOB, [out, 1, tp, 3 - tp, 1, "2", ckpt, "offload=1", "seqs=2", "pool=30",
                     "max_tokens=24", "first=100"], timeout=600)  # p1a1e2; TP 2: p1a1e1
    got = json.loads(out.read_text())
    assert got[f"{ckpt}|m=2|off=1"] == _greedy(ckpt, 24, 100)
    stats = got[f"{ckpt}|m=2|off=1|stats"]
    decode, prefill = stats["offload"][0], stats["offload"][-1]
    assert decode["sent_home"] >= 1, stats
    for d in stats["offload"][:tp]:  # every decode TP rank brought each one home
        assert d["homed"] + d["returned"] == decode["sent_home"], stats
    assert prefill["home"] == decode["homed"] and decode["homed"] >= 1, stats
    assert decode["chosen"] == decode["started"] > decode["sent_home"], stats
    assert 0 < decode["busy_s"][0] < 600, stats  # the prefill rank's busy seconds, reported
    _check_freed(stats["offload"])


def test_prefill_rank_silent_on_offloaded_attention_ends_the_job(tiny_ckpts, tmp_path):
    ckpt = tiny_ckpts[("mixtral", "base")]
    with pytest.raises(AssertionError) as e:
        run_mpi(4, JOB, [tmp_path / "o.json", 1, 1, 2, 1, "2", ckpt, "offload=1",
                         "fault=hang_offload"], timeout=300)
    msg = str(e.value)
    assert "exited" in msg  # it ended by itself, not by the test's timeout
    assert "rank 3 did not answer within" in msg and "offloaded decode attention" in msg
