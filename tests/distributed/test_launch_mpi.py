"""``mpirun -n N megainfer-launch`` end to end: the default job, heterogeneous launches, a
world size that does not fit the plan, and a rank that hangs or dies mid-run (bounded exit,
error naming the rank and phase, finished lines on disk, a rerun completes the rest)."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from mpi_util import mpiexec_path

LAUNCH = os.path.join(os.path.dirname(sys.executable), "megainfer-launch")


def _env(mark: str = "") -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MEGAINFER_TEST_MARK=mark)


def _launch(args, cwd, timeout=300, mark=""):
    return subprocess.run([mpiexec_path(), *args], cwd=cwd, env=_env(mark), capture_output=True,
                          text=True, timeout=timeout)


def _lines(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_default_job_three_ranks(tmp_path):
    p = _launch(["-n", "3", LAUNCH], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == "generations.jsonl"]
    assert len(runs) == 1, runs  # one run directory, written by rank 0 alone
    assert len(_lines(runs[0])) == 8
    assert "[launch] summary (disaggregated, 3 ranks)" in p.stdout
    assert not [f for f in os.listdir(tmp_path) if f != "outputs"]  # no stray files


def test_heterogeneous_launch_and_trace(tmp_path, tiny_ckpts):
    ckpt = tiny_ckpts[("qwen2_moe", "base")]
    args = [f"model.path={ckpt}", "deploy=a1e2", "deploy.micro_batches=3", "sampling.max_tokens=6",
            "trace.enabled=true", f"hydra.run.dir={tmp_path}/run"]
    p = _launch(["-n", "1", LAUNCH, *args, ":", "-n", "2", LAUNCH, *args], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(_lines(tmp_path / "run" / "generations.jsonl")) == 8
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    _check_trace(trace, 3, ("attention", "A2E", "expert", "E2A"))
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    lanes = {(e["pid"], e["cat"]) for e in ev}
    assert {(0, "attention"), (0, "A2E"), (0, "E2A"), (1, "expert"), (2, "expert"),
            (1, "A2E"), (1, "E2A")} <= lanes
    key = lambda e: (e["args"]["iter"], e["args"]["layer"], e["args"]["mb"])  # noqa: E731
    sent = {key(e): e["ts"] for e in ev if e["pid"] == 0 and e["cat"] == "A2E"}
    back = {key(e): e["ts"] + e["dur"] for e in ev if e["pid"] == 0 and e["cat"] == "E2A"}
    experts = [e for e in ev if e["cat"] == "expert"]
    assert len(experts) == 2 * len(sent) > 0
    for e in experts:  # causal order on one clock: A2E before the expert, expert before E2A
        assert sent[key(e)] <= e["ts"] + 50 and e["ts"] + e["dur"] <= back[key(e)] + 50, e
    assert "communication hidden" in p.stdout
    # the picture of a steady-state iteration, and the pipeline figures as summary fields
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    pipe = summary["pipeline"]
    assert pipe["mode"] == "disaggregated" and pipe["T_a_us"] > 0 and pipe["T_e_us"] > 0
    assert 0 <= pipe["hidden_fraction"] <= 1 and pipe["events"] == len(ev)
    assert pipe["timeline"] == str(tmp_path / "run" / "timeline.png") and pipe["timeline_iteration"] > 0
    assert (tmp_path / "run" / "timeline.png").stat().st_size > 10_000


def _check_trace(trace, ranks, lanes):
    """Valid Chrome trace: every rank named, with all four lanes; complete events well formed."""
    meta = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    for pid in range(ranks):
        names = {e["args"]["name"] for e in meta if e["pid"] == pid and e["name"] == "thread_name"}
        assert names == set(lanes), (pid, names)
        assert any(e["pid"] == pid and e["name"] == "process_name" for e in meta)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            assert e["dur"] >= 0 and e["cat"] in lanes and lanes.index(e["cat"]) == e["tid"]


def test_colocated_traced_launch(tmp_path):
    args = ["deploy=colocated2", "deploy.micro_batches=2", "trace.enabled=true",
            f"hydra.run.dir={tmp_path}/run"]
    p = _launch(["-n", "2", LAUNCH, *args], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[launch] summary (colocated, 2 ranks)" in p.stdout
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    _check_trace(trace, 2, ("attention", "dispatch", "expert", "combine"))
    lanes = {(e["pid"], e["cat"]) for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {(r, lane) for r in (0, 1) for lane in ("attention", "dispatch", "expert", "combine")} <= lanes


def test_world_size_that_does_not_fit_the_plan(tmp_path):
    p = _launch(["-n", "2", LAUNCH, "deploy=a2e4"], tmp_path, timeout=120)
    assert p.returncode != 0
    assert "needs 6 ranks" in p.stderr and "world size 2" in p.stderr


@pytest.mark.parametrize("args,code", [(["deploy.micro_batchs=2"], 1),  # Hydra refuses the key
                                       (["sampling.top_p=0"], 2)])  # megainfer refuses the value
def test_a_start_up_error_is_printed_once_not_per_rank(tmp_path, args, code):
    single = subprocess.run([LAUNCH, *args], cwd=tmp_path, env=_env(), capture_output=True,
                            text=True, timeout=120)
    p = _launch(["-n", "3", LAUNCH, *args], tmp_path, timeout=120)
    assert p.returncode == single.returncode == code, p.stderr[-3000:]
    assert p.stderr == single.stderr and single.stderr.strip()  # rank 0's report, as one process
    if code == 1:
        return
    # ranks that disagree: rank 0 names the ones that failed
    p = _launch(["-n", "1", LAUNCH, ":", "-n", "2", LAUNCH, "sampling.top_p=0"], tmp_path,
                timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "[launch] error: ConfigError: sampling.top_p=0: must be in (0, 1] (ranks 1, 2)"]


def _pid_of_rank(mark: str, rank: int, deadline: float) -> int:
    """The pid of the launched process with PMI_RANK=rank and our marker in its environment."""
    while time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if f"MEGAINFER_TEST_MARK={mark}".encode() in env and f"PMI_RANK={rank}".encode() in env:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"no process of rank {rank} found")


def _write_prompts(path, n=24):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"q{i}", "prompt_token_ids": [3 + (i * 7 + j) % 200
                                                                    for j in range(4 + i % 9)]}) + "\n")


@pytest.mark.parametrize("fault", ["hang", "kill"])
def test_expert_rank_failure_is_bounded_and_resumable(tmp_path, tiny_ckpts, fault):
    ckpt = tiny_ckpts[("mixtral", "base")]
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    _write_prompts(prompts)
    args = ["-n", "3", LAUNCH, f"model.path={ckpt}", "deploy=a1e2", f"io.input={prompts}",
            f"io.output={out}", "sampling.max_tokens=40", "sampling.ignore_eos=true",
            "scheduler.max_num_seqs=4", "comm.timeout_s=5", "io.progress=false",
            f"hydra.run.dir={tmp_path}/run"]
    proc, stdout, err, victim, took = _launch_and_fault(args, tmp_path, out, 2, fault, 60)
    assert proc.returncode != 0
    assert took < 45, f"exit took {took:.1f}s"
    assert f"2 [expert 1] pid {victim}" in stdout  # rank 0's start-up line maps pids to ranks
    if fault == "hang":  # our timeout names the silent peer and what we were doing
        # read from the rank's error file: mpiexec may drop what a rank printed just before
        # MPI_Abort, so stderr alone would make this test flaky
        report = (tmp_path / "run" / "error.rank0.txt").read_text()
        line = report.splitlines()[0]
        assert line.startswith("[attn dp0 tp0] error: CommTimeoutError"), report[-2000:]
        assert "peer rank 2 timed out" in line and "layer=" in line and "micro_batch=" in line
        assert "Traceback (most recent call last)" in report
    else:  # a dead process: MPICH's process manager reports it and ends the others at once
        assert "BAD TERMINATION" in stdout + err
    _check_resume(args, tmp_path, out, ckpt, prompts)


def _launch_and_fault(args, tmp_path, out, rank: int, fault: str, timeout: float):
    """Start the job, stop (``hang``) or kill rank ``rank`` once two lines are written, and wait
    for the job to end: (process, stdout, stderr, the victim's pid, seconds to exit)."""
    mark = uuid.uuid4().hex
    proc = subprocess.Popen([mpiexec_path(), *args], cwd=tmp_path, env=_env(mark), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    victim = None
    try:
        victim = _pid_of_rank(mark, rank, time.time() + 60)
        while len(_lines(out)) < 2 and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the job finished before the fault could be injected"
        os.kill(victim, signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
        t0 = time.time()
        stdout, err = proc.communicate(timeout=timeout)
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if victim is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(victim, sig)
                except ProcessLookupError:
                    pass
    return proc, stdout, err, victim, took


def _check_resume(args, tmp_path, out, ckpt, prompts):
    """After a failed run: the same command resumes, keeps what was written, finishes every
    request, with single mode's tokens."""
    done = _lines(out)
    assert 2 <= len(done) < 24
    p = _launch(args, tmp_path, timeout=300)  # the same command resumes
    assert p.returncode == 0, p.stderr[-3000:]
    final = _lines(out)
    assert sorted(r["id"] for r in final) == sorted(f"q{i}" for i in range(24))
    assert final[:len(done)] == done  # nothing already written was rewritten
    _check_tokens_match_single_mode(ckpt, prompts, final)


def _check_tokens_match_single_mode(ckpt, prompts, lines):
    from megainfer import LLM, SamplingParams
    llm = LLM(model=ckpt)
    reqs = [json.loads(l) for l in open(prompts)]
    outs = llm.generate([r["prompt_token_ids"] for r in reqs],
                        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)
    want = {r["id"]: o.outputs[0].token_ids for r, o in zip(reqs, outs)}
    assert {l["id"]: l["token_ids"] for l in lines} == want
