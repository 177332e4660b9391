"""Re-planning online (docs/replan.md, "Online"): ``LLM(deploy=...)`` and ``AsyncLLM(deploy=...)``
under ``mpiexec -n 3`` with forced switches a1e2 -> a2e1 -> a1e2 (-> a2e1) while the engine
core serves give single mode's tokens; streams go on across a switch with no token lost or
repeated; an abort of a running request, and a request that arrives (or arrives and is
aborted) while every rank switches, end exactly once; the blocks of every replica come back;
an idle runtime sleeps after its switches, every rank."""
import json
import os
import sys

import pytest

from mpi_util import run_mpi
from repo_paths import MPI_PROGS

sys.path.insert(0, MPI_PROGS)
from llm_deploy_job import ENGINE_ARGS, offline_outputs  # noqa: E402
from llm_replan_job import IN_ORDER_SYNC, VICTIMS, switch_requests  # noqa: E402

JOB = os.path.join(MPI_PROGS, "llm_replan_job.py")
BACK_AND_FORTH = [["a1e2", "a2e1"], ["a2e1", "a1e2"], ["a1e2", "a2e1"]]


A2E1 = {"mode": "disaggregated", "attention_replicas": 2, "attention_tp": 1, "expert_ranks": 1}


def _run(tmp_path, ckpt, what, force, start="a1e2", *overrides):
    out = tmp_path / "out.json"
    deploy = json.dumps(A2E1) if start == "a2e1" else start
    run_mpi(3, JOB, [out, ckpt, deploy, what, json.dumps(force), *overrides], timeout=500)
    return json.loads(out.read_text())


def test_llm_generate_across_forced_switches_equals_single_mode(tiny_ckpts, tmp_path):
    from megainfer import LLM
    ckpt = tiny_ckpts[("mixtral", "base")]
    got = _run(tmp_path, ckpt, "offline", [[3, "a2e1"], [9, "a1e2"], [16, "a2e1"]])
    assert [r[:2] for r in got["replans"]] == BACK_AND_FORTH
    # inside the first generate: the new replica got requests, the leaving one handed its own
    assert all(r[2] >= 1 for r in got["replans"][:2]), got["replans"]
    assert got["plan"] == [2, 1]
    want = offline_outputs(LLM(ckpt, **ENGINE_ARGS))
    for key in want.keys() - {"logprobs"}:
        assert got[key] == want[key], key
    assert [[[t for t, _ in pos] for pos in o] for o in got["logprobs"]] == \
        [[[t for t, _ in pos] for pos in o] for o in want["logprobs"]]
    assert max(got["idle_cpu"]) < 0.05, got["idle_cpu"]  # every rank sleeps, roles changed


def test_llm_generate_with_measured_decisions_equals_single_mode(tiny_ckpts, tmp_path):
    """No forced schedule: rank 0 gathers the expert ranks' spans every 3 iterations online
    and decides (min_gain 0: any predicted gain switches); the tokens stay single mode's."""
    from megainfer import LLM
    ckpt = tiny_ckpts[("mixtral", "base")]
    got = _run(tmp_path, ckpt, "offline", [], "a1e2", "replan.interval=3", "replan.min_gain=0")
    assert got["decisions"], got  # decisions were made (with work), every 3 iterations
    assert all(it % 3 == 0 for it, _ in got["decisions"]), got["decisions"]
    assert len(got["replans"]) == sum(s for _, s in got["decisions"])
    want = offline_outputs(LLM(ckpt, **ENGINE_ARGS))
    for key in ("greedy", "seeded", "stop", "chat"):
        assert got[key] == want[key], key


def _single_switch_reference(ckpt, vocab):
    from megainfer import LLM, SamplingParams
    reqs = switch_requests(vocab)
    llm = LLM(ckpt, **ENGINE_ARGS)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs.values()],
                        [SamplingParams(**kw) for _, kw in reqs.values()], use_tqdm=False)
    return {rid: o.outputs[0].token_ids for rid, o in zip(reqs, outs)}


@pytest.mark.parametrize("start,kv", [("a1e2", "move"), ("a2e1", "recompute")])
def test_async_llm_streams_and_aborts_across_switches_equal_single_mode(tiny_ckpts, tmp_path,
                                                                        start, kv):
    """From a2e1 rank 1 streams from the start (its first hand-out says so), from a1e2 only
    once a switch made it a replica; requests that change replica take their KV along, or
    recompute it (and only it: their tokens come once)."""
    from megainfer.config import ModelConfig
    from test_llm_deploy import _check_streams, _single
    ckpt = tiny_ckpts[("mixtral", "base")]
    plans = ["a1e2", "a2e1"] if start == "a1e2" else ["a2e1", "a1e2"]
    force = [[3, plans[1]], [14, plans[0]], [24, plans[1]]]
    got = _run(tmp_path, ckpt, "async", force, start, f"replan.kv_transfer={kv}")
    assert [r[:2] for r in got["replans"]] == [plans, plans[::-1], plans]
    assert all(r[2] >= 1 for r in got["replans"][:2]), got["replans"]  # requests moved
    assert got["replans"][1][3 if kv == "move" else 4] >= 1, got["replans"]  # running ones too
    assert all(got["during"]), got["during"]  # the actions were queued while every rank switched
    want = _single_switch_reference(ckpt, ModelConfig.from_pretrained(ckpt).vocab_size)
    streams = got["streams"]
    for rid, s in streams.items():
        tokens = s["tokens"][0]
        assert s["finished"] and s["seen"] == sorted(s["seen"]), rid
        assert s["seen"][-1] == len(tokens), rid
        if rid in {*VICTIMS.values(), IN_ORDER_SYNC, "c1", "c2"}:  # aborted: once, so far
            assert s["finish"] == ["abort"] and tokens == want[rid][:len(tokens)], rid
            assert len(tokens) < len(want[rid]), rid
        else:  # every token once, in order, through the switches
            assert tokens == want[rid] and s["finish"] == ["length"], rid
            assert len(s["seen"]) >= 2, rid
    # then, on the plan the switches left: streams, aborts, arrivals
    after = got["after"]
    _check_streams(after, _single(ckpt, "async"))
    # every token came once as a new token of an iteration, whichever replica made it
    finals = {rid: len(s["tokens"][0]) for rid, s in streams.items()}
    finals.update({f"s{i}": len(s["tokens"][0]) for i, s in enumerate(after["streams"])})
    finals.update({k: len(after[k]["tokens"][0]) for k in ("aborted", "early", "at_once")})
    finals["long"] = finals.pop("aborted")
    assert {rid: got["new_tokens"].get(rid, 0) for rid in finals} == finals
    assert got["idle_load"] == [0, 0, 0, 0.0], got["idle_load"]  # every replica's blocks back
