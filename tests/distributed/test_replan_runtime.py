"""Re-planning in the running system (real mpiexec -n 4): switches forced a1e3 -> a2e2 -> a1e3
while requests run leave the greedy tokens unchanged, hand running requests over with their
KV or to recompute (with live EPLB moving weights too), and leave every expert slot holding its
checkpoint weights; a rank hung in a switch ends the job, named."""
import json
import os
import sys

import pytest

from mpi_util import run_mpi

JOB = os.path.join(os.path.dirname(__file__), "mpi_progs", "replan_job.py")


def _job():
    """tests/distributed/mpi_progs/replan_job.py as a module (imported here, not at collection: it sets
    torch to one thread)."""
    sys.path.insert(0, os.path.dirname(JOB))
    import replan_job
    return replan_job


def _run(tiny_ckpts, tmp_path, modes=None, **ref) -> tuple[dict, dict]:
    """replan_job.py under mpiexec -n 4 on tiny Mixtral (``modes``: its comma list; None: the
    forced move/recompute pair): (its results by mode, single mode's tokens, ``reference(**ref)``)."""
    ckpt = tiny_ckpts[("mixtral", "base")]
    out = tmp_path / f"replan_{modes or 'forced'}.json"
    run_mpi(4, JOB, [out, ckpt] + ([modes] if modes else []), timeout=600)
    return json.loads(out.read_text()), _job().reference(ckpt, **ref)


def test_forced_switches_both_ways_keep_tokens_and_weights(tiny_ckpts, tmp_path):
    res, want = _run(tiny_ckpts, tmp_path)
    FORCE = _job().FORCE
    for mode in ("move", "recompute"):
        run = res[mode]
        assert run["tokens"] == want, mode
        recs = run["records"]
        assert [(r["iteration"], r["old"], r["new"]) for r in recs] == \
            [(FORCE[0][0], "a1e3", "a2e2"), (FORCE[1][0], "a2e2", "a1e3")]
        assert run["marks"] == 2  # one trace mark per switch on rank 0
        assert recs[0]["weight_bytes"] > 0 and recs[1]["weight_bytes"] > 0
        # the new replica got its share of replica 0's requests at once
        assert recs[0]["move"] + recs[0]["recompute"] + recs[0]["waiting"] >= 1, recs[0]
        # requests in flight on the leaving replica were handed over, as asked
        handed = recs[1]["move"] if mode == "move" else recs[1]["recompute"]
        assert handed >= 1, recs[1]
        assert (recs[1]["kv_bytes"] > 0) == (mode == "move")
        # rank 1: expert -> attention -> expert; ranks 2, 3 stay expert ranks
        assert [c[0] for c in run["checks"][1]] == ["attention", "expert"]
        assert run["final"][0] == ["attention", None, 0]
        for rank in (1, 2, 3):
            assert all(ok for kind, ok in run["checks"][rank] if kind == "expert"), run["checks"]
            assert run["final"][rank][:2] == ["expert", True]
    # the recompute run also rebalances live (EPLB every 3 iterations) between the switches
    assert min(f[2] for f in res["recompute"]["final"][1:]) >= 1


def test_requests_of_two_seeded_samples_move_whole_and_sample_as_in_single_mode(tiny_ckpts,
                                                                                tmp_path):
    """Half the requests ask for n=2 seeded samples (temperature 0.8): groups in flight on the
    leaving replica at a2e2 -> a1e3 move whole (both samples, KV moved or recomputed) and every
    sample's tokens equal single mode's."""
    res, want = _run(tiny_ckpts, tmp_path, "n2,n2r", n2=True)
    FORCE = _job().FORCE
    assert sum(isinstance(t[0], list) for t in want.values()) == 6  # 6 requests of 2 samples
    for mode in ("n2", "n2r"):
        run = res[mode]
        assert run["tokens"] == want, mode
        recs = run["records"]
        assert [(r["iteration"], r["new"]) for r in recs] == [(f[0], f[1]) for f in FORCE]
        # the leaving replica handed over samples of n=2 requests, as asked
        assert recs[1]["multi"] >= 2, recs[1]
        handed = recs[1]["move"] if mode == "n2" else recs[1]["recompute"]
        assert handed >= 2 and (recs[1]["kv_bytes"] > 0) == (mode == "n2"), recs[1]


def test_forced_switches_that_change_the_micro_batch_count_keep_tokens_and_weights(
        tiny_ckpts, tmp_path):
    """a1e3 (m=2) -> a1e3m3 (the count alone) -> a2e2m1 -> a1e3m2, requests in flight."""
    res, want = _run(tiny_ckpts, tmp_path, "m")
    run = res["m"]
    assert run["tokens"] == want
    assert [(r["iteration"], r["old"], r["new"], r["micro_batches"]) for r in run["records"]] == [
        (4, "a1e3m2", "a1e3m3", [2, 3]), (8, "a1e3m3", "a2e2m1", [3, 1]),
        (13, "a2e2m1", "a1e3m2", [1, 2])]
    for rank in (1, 2, 3):
        assert all(ok for kind, ok in run["checks"][rank] if kind == "expert"), run["checks"]
    assert [c[0] for c in run["checks"][1]] == ["expert", "attention", "expert"]


def test_measured_decisions_refit_from_traced_spans_and_keep_tokens(tiny_ckpts, tmp_path):
    """replan.interval=3, min_gain=0: rank 0 gathers every expert rank's spans and its own each
    interval, refits and decides; whatever it decides, the tokens stay the single-mode ones."""
    res, want = _run(tiny_ckpts, tmp_path, "auto")
    run = res["auto"]
    assert run["tokens"] == want
    ds = run["decisions"]
    assert ds and [d["iteration"] for d in ds] == list(range(3, 3 * len(ds) + 1, 3))
    assert ds[0]["attention_samples"] > 0 and ds[0]["expert_samples"] > 0
    # T_c traced (rank 0's combine waits against the expert ranks' reply times) reaches the model
    assert ds[0]["comm_samples"] > 0 and 0 < ds[0]["t_c"] < 1.0, ds[0]
    refitted = [d for d in ds if not d["reason"].startswith("cannot refit")]
    assert refitted  # at least one decision had the two batch sizes a fit needs
    assert len(run["records"]) == sum(d["switch"] for d in ds) == run["marks"]
    for rec in run["records"]:
        assert rec["reason"].startswith("measured") and rec["predicted_gain"] > 0


@pytest.mark.parametrize("where, phase", [
    ("hang", "during re-plan expert placement"),
    # the others are inside collective calls there: bounded too, and rank 2 named
    ("hang_dup", "during re-plan start (communicator duplication)"),
    ("hang_channels", "during re-plan channel rebuild (all-gather)")])  # transport auto's first
def test_a_rank_hung_in_a_switch_ends_the_job_naming_it_and_the_phase(tiny_ckpts, tmp_path,
                                                                      where, phase):
    ckpt = tiny_ckpts[("mixtral", "base")]
    with pytest.raises(AssertionError) as e:  # run_mpi: the job exited non-zero, not a timeout
        run_mpi(4, JOB, [tmp_path / "hang.json", ckpt, where], timeout=300)
    msg = str(e.value)
    assert "timed out" not in msg.splitlines()[0]
    assert "rank 2 did not answer within 4.0s" in msg and phase in msg, msg[-3000:]
