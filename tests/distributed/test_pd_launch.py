"""``mpirun -n 4 megainfer-launch deploy=p1a1e2`` end to end (docs/pd.md): tokens, the
summary's handoff figures, the KV trace lanes, and a prefill rank stopped or killed mid-job
(bounded exit, lines on disk kept, the same command resumes)."""
import json

import pytest


def test_launch_with_a_prefill_rank_summary_trace_and_tokens(tmp_path, tiny_ckpts):
    """``deploy=p1a1e2``: the default workload's sampled (seeded) tokens equal a1e2's, each
    line has kv_handoff_s, the summary its p50/p99, the trace the KV lanes on both sides."""
    from test_launch_mpi import LAUNCH, _launch, _lines
    ckpt = tiny_ckpts[("qwen3_moe", "base")]
    got = {}
    for deploy, n in (("a1e2", 3), ("p1a1e2", 4)):
        args = [f"model.path={ckpt}", f"deploy={deploy}", "sampling.max_tokens=6",
                "sampling.temperature=0.8", "sampling.top_k=20",
                "io.progress=false", f"hydra.run.dir={tmp_path}/{deploy}"]
        if deploy == "p1a1e2":
            args.append("trace.enabled=true")
        p = _launch(["-n", str(n), LAUNCH, *args], tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        got[deploy] = {r["id"]: r for r in _lines(tmp_path / deploy / "generations.jsonl")}
    assert len(got["a1e2"]) == 8
    assert {k: r["token_ids"] for k, r in got["a1e2"].items()} == \
        {k: r["token_ids"] for k, r in got["p1a1e2"].items()}
    assert all(r["kv_handoff_s"] > 0 for r in got["p1a1e2"].values())
    assert "prefill end -> decode start p50 / p99 (ms)" in p.stdout
    summary = json.loads((tmp_path / "p1a1e2" / "summary.json").read_text())
    assert summary["kv_handoff_p99_ms"] >= summary["kv_handoff_p50_ms"] > 0
    trace = json.loads((tmp_path / "p1a1e2" / "trace.json").read_text())
    lanes = {(e["pid"], e["cat"]) for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {(3, "prefill"), (3, "KV send"), (0, "KV recv"), (0, "attention"),
            (1, "expert")} <= lanes


@pytest.mark.parametrize("fault", ["hang", "kill"])
def test_launch_prefill_rank_failure_is_bounded_and_resumable(tmp_path, tiny_ckpts, fault):
    from test_launch_mpi import LAUNCH, _check_resume, _launch_and_fault, _write_prompts
    ckpt = tiny_ckpts[("mixtral", "base")]
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    _write_prompts(prompts)
    args = ["-n", "4", LAUNCH, f"model.path={ckpt}", "deploy=p1a1e2", f"io.input={prompts}",
            f"io.output={out}", "sampling.max_tokens=40", "sampling.ignore_eos=true",
            "scheduler.max_num_seqs=4", "comm.timeout_s=5", "io.progress=false",
            f"hydra.run.dir={tmp_path}/run"]
    proc, stdout, err, victim, _ = _launch_and_fault(args, tmp_path, out, 3, fault, 90)
    assert proc.returncode != 0
    assert f"3 [prefill 0] pid {victim}" in stdout
    if fault == "hang":
        line = (tmp_path / "run" / "error.rank0.txt").read_text().splitlines()[0]
        assert line.startswith("[attn dp0 tp0] error: RankFailure"), line
        assert "rank 3 did not answer within" in line and "prefill of request 'q" in line
    else:
        assert "BAD TERMINATION" in stdout + err
    _check_resume(args, tmp_path, out, ckpt, prompts)
