"""The engine core of a plain script's own ``mpiexec`` child job (``ChildJobClient``), in single
mode (one rank) and a1e2 (three): single mode's greedy tokens, aborts, shutdown, a killed or
hung rank named by ``RankLostError`` within ``comm.timeout_s``, and no process left behind
however the script ends (close, ``with``, garbage collection, interpreter exit, an uncaught
exception, SIGTERM, SIGINT, SIGKILL of the script, SIGKILL of a rank; docs/python_api.md,
"Ranks started from a plain script")."""
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from repo_paths import MPI_PROGS

sys.path.insert(0, MPI_PROGS)
from spawned_core_script import Collector, add, job_tree  # noqa: E402
from runtime_job import inputs  # noqa: E402

from megainfer.engine.failures import CoreStartError, EngineDeadError, RankLostError  # noqa
from megainfer.core_client.request_stream import Intake  # noqa: E402
from megainfer.core_client.mpiexec_job import pid_alive  # noqa: E402
from megainfer.core_client.spawn import ChildJobClient  # noqa: E402
from megainfer.engine_core.messages import AbortRequest, AddRequest  # noqa: E402

SCRIPT = os.path.join(MPI_PROGS, "spawned_core_script.py")
GONE_S = 15.0  # a job's processes are all gone within this after the script's end


def _pids(core) -> list[int]:
    return [core.job.pid] + [r.pid for r in core.ranks]


def _assert_gone(pids, marker: str, within: float = GONE_S) -> None:
    """Every pid of the job gone, and no process naming its socket (pgrep -f)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        left = [p for p in pids if pid_alive(p)]
        found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
        if not left and not found.strip():
            return
        time.sleep(0.1)
    raise AssertionError(f"left behind: pids {left}, pgrep -f {marker}: {found!r}")


@pytest.fixture(scope="module")
def ckpt(tiny_ckpts):
    return tiny_ckpts[("mixtral", "base")]


ROLES = {"single": ["[attn dp0 tp0]"], "a1e2": ["[attn dp0 tp0]", "[expert 0]", "[expert 1]"]}


@pytest.mark.parametrize("deploy", list(ROLES))
def test_greedy_tokens_abort_and_shutdown(ckpt, single_mode_tokens, deploy):
    """Greedy tokens equal in-process single mode's; an abort ends a running request with
    "abort" while the others go on; shutdown ends the requests still running with "abort";
    then no process of the job is left."""
    spec = job_tree(ckpt, deploy)
    intake = Intake.for_job(spec.resolve(0))
    col = Collector()
    core = ChildJobClient(spec, col.deliver)
    pids, marker = _pids(core), core.job.marker
    assert [r.role for r in core.ranks] == ROLES[deploy] and core.alive
    try:
        reqs = inputs(intake.vocab_size, 12)
        add(core, intake, "doomed", [9, 8, 7], max_tokens=100)
        for r in reqs:
            core.submit(_add_request(intake, r))
        col.until_tokens("doomed")
        core.submit(AbortRequest("doomed"))
        done = col.until_done([r.request_id for r in reqs] + ["doomed"])
        assert done["doomed"].outputs[0].finish_reason == "abort"
        assert len(done["doomed"].outputs[0].token_ids) < 100
        got = {r.request_id: done[r.request_id].outputs[0].token_ids for r in reqs}
        assert got == single_mode_tokens[ckpt]
        add(core, intake, "running", [4, 5], max_tokens=100)
        col.until_tokens("running")
    finally:
        core.shutdown()
    last = col.until_done(["running"], timeout=5)
    assert last["running"].outputs[0].finish_reason == "abort"
    assert not core.alive and core.job.returncode() == 0
    with pytest.raises(EngineDeadError):
        add(core, intake, "late", [1])
    _assert_gone(pids, marker, within=1.0)


def _add_request(intake, r):
    return AddRequest(r.request_id, intake.tokenize(None, r.params, r.prompt_token_ids), r.params)


def test_with_block_and_garbage_collection_end_the_job(ckpt):
    spec = job_tree(ckpt)
    with pytest.raises(ZeroDivisionError):
        with ChildJobClient(spec, Collector().deliver) as core:
            pids, marker = _pids(core), core.job.marker
            1 / 0
    _assert_gone(pids, marker, within=1.0)
    core = ChildJobClient(spec, Collector().deliver)
    pids, marker = _pids(core), core.job.marker
    del core
    gc.collect()
    _assert_gone(pids, marker, within=1.0)


FAULTS = {  # deploy, the rank hit, the signal, comm.timeout_s, its role, the error's words
    "single-rank0-killed": ("single", 0, signal.SIGKILL, 10.0, "[attn dp0 tp0]", "died"),
    "single-rank0-stopped": ("single", 0, signal.SIGSTOP, 3.0, "[attn dp0 tp0]", "hangs"),
    "a1e2-expert1-killed": ("a1e2", 2, signal.SIGKILL, 10.0, "[expert 1]", "died"),
    # a hung expert: rank 0's control plane names it after comm.timeout_s (RankFailure)
    "a1e2-expert0-stopped": ("a1e2", 1, signal.SIGSTOP, 4.0, "[expert 0]", "stopped answering"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_lost_rank_raises_rank_lost_error_naming_it(ckpt, fault):
    """A rank killed (SIGKILL) or stopped (SIGSTOP: it hangs) mid-generate raises
    RankLostError naming its rank and role within comm.timeout_s (plus the watch's poll),
    later inputs raise it too, and no process of the job is left."""
    deploy, rank, sig, timeout_s, role, words = FAULTS[fault]
    err = _fails_naming(ckpt, deploy, timeout_s, words,
                        lambda core: os.kill(core.ranks[rank].pid, sig))
    assert (err.rank, err.role) == (rank, role), err


def _fails_naming(ckpt, deploy: str, timeout_s: float, words: str, fault=None,
                  within: float = None):
    """A spawned ``deploy`` job runs a long request to its first tokens, then ``fault(core)``:
    the RankLostError (matching ``words``) that ends it within ``within`` (default
    ``timeout_s``) + 3 s; later inputs raise it too and no process of the job is left."""
    spec = job_tree(ckpt, deploy, timeout_s)
    intake = Intake.for_job(spec.resolve(0))
    col = Collector()
    core = ChildJobClient(spec, col.deliver)
    pids, marker = _pids(core), core.job.marker
    try:
        add(core, intake, "long", [3, 4], max_tokens=120)
        col.until_tokens("long")
        t0 = time.monotonic()
        if fault is not None:
            fault(core)
        with pytest.raises(RankLostError, match=words) as e:
            while True:
                col.next(timeout=timeout_s + 10)
        assert time.monotonic() - t0 < (within or timeout_s) + 3.0
        assert not core.alive
        with pytest.raises(RankLostError):
            add(core, intake, "late", [1])
        _assert_gone(pids, marker, within=5.0)
        return e.value
    finally:
        core.shutdown()


HANG_AFTER_STEPS = "MEGAINFER_TEST_HANG_AFTER_STEPS"
# the child job's ranks import this first (PYTHONPATH): rank 0's engine core thread then blocks
# for good in the step after the given number, while its main thread goes on (heartbeats)
SITECUSTOMIZE = f"""import os, threading
if os.environ.get("{HANG_AFTER_STEPS}"):
    from megainfer.engine.engine import LLMEngine
    from megainfer.runtime.runtime_engine import RuntimeEngine
    left = [int(os.environ["{HANG_AFTER_STEPS}"])]
    def hanging(step):
        def step_outputs(self):
            left[0] -= 1
            if left[0] < 0:
                threading.Event().wait()
            return step(self)
        return step_outputs
    for cls in (LLMEngine, RuntimeEngine):
        cls.step_outputs = hanging(cls.step_outputs)
"""


@pytest.mark.parametrize("deploy", ["single", "a1e2"])
def test_an_engine_core_stuck_in_a_step_is_named_hung(ckpt, tmp_path, monkeypatch, deploy):
    """Rank 0's core thread stuck inside one iteration while rank 0's main thread lives (its
    heartbeats alone would hide it): RankLostError naming rank 0 and "hangs" within
    comm.timeout_s (+ the main thread's poll), before any expert rank's own (2x) wait runs
    out; no process of the job is left."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    monkeypatch.setenv(HANG_AFTER_STEPS, "6")  # it steps, then hangs in its 7th step
    from megainfer.runtime.timeouts import CORE_HANG
    factor = 1.0 if deploy == "single" else CORE_HANG  # the runtime's peers first
    err = _fails_naming(ckpt, deploy, 3.0, "hangs", within=factor * 3.0)
    assert (err.rank, err.role) == (0, "[attn dp0 tp0]"), err
    assert "inside one iteration" in str(err)


LLM_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, block_size=4,
                num_blocks=256, cpu_threads=1, overrides=["comm.timeout_s=10"])


def test_llm_a1e2_from_a_plain_process(ckpt):
    """``LLM(deploy="a1e2")`` in this (plain, non-MPI) process starts its 3 ranks itself: its
    greedy tokens equal single mode's; an expert rank killed mid-generate raises
    RankLostError naming it out of ``generate``; then nothing of the job is left."""
    from megainfer import LLM, SamplingParams
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], [9, 10, 11, 12, 13], [3])]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    single = LLM(ckpt, **LLM_ARGS)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    llm = LLM(ckpt, deploy="a1e2", **LLM_ARGS)
    core = llm._client.core
    assert isinstance(core, ChildJobClient)
    pids, marker = _pids(core), core.job.marker
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want

        def kill_expert_once_generating():
            start = llm._client.num_generated_tokens
            while llm._client.num_generated_tokens == start:
                time.sleep(0.005)
            os.kill(core.ranks[2].pid, signal.SIGKILL)
        threading.Thread(target=kill_expert_once_generating, daemon=True).start()
        long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        with pytest.raises(RankLostError) as e:
            llm.generate(prompts, long, use_tqdm=False)
        assert (e.value.rank, e.value.role) == (2, "[expert 1]"), e.value
    finally:
        llm.close()
    _assert_gone(pids, marker, within=5.0)


def test_start_failures_raise_with_the_job_output(ckpt, tmp_path):
    """A rank that cannot start (its config does not resolve) and a start that outlasts its
    bound raise CoreStartError carrying the job's output; the job is ended."""
    bad = job_tree(ckpt)
    bad.tree["scheduler"]["max_num_seqs"] = 0
    with pytest.raises(CoreStartError, match=r"did not start: \[rank 0\] failed to start: "
                       r"ConfigError: scheduler.max_num_seqs=0") as e:
        ChildJobClient(bad, Collector().deliver)
    assert "the job's last output lines" in str(e.value)
    with pytest.raises(CoreStartError, match="timed out"):
        ChildJobClient(job_tree(ckpt), Collector().deliver, start_timeout_s=0.5)
    left = subprocess.run(["pgrep", "-f", "megainfer.engine_core.child_main"], capture_output=True,
                          text=True)
    mine = [p for p in left.stdout.split() if _started_by_me(int(p))]
    assert not mine, mine


def _started_by_me(pid: int) -> bool:
    """A process under this test process (the child_main processes of its own jobs)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return f"MEGAINFER_TEST_PARENT={os.getpid()}".encode() in env


@pytest.fixture(autouse=True)
def _tag_children(monkeypatch):
    monkeypatch.setenv("MEGAINFER_TEST_PARENT", str(os.getpid()))


ENDINGS = {  # deploy, script mode, signal sent once it generates, its expected exit status
    "exit": ("single", "exit", None, 0), "raise": ("single", "raise", None, 1),
    "sigterm": ("single", "wait", signal.SIGTERM, 128 + signal.SIGTERM),
    "sigint": ("single", "wait", signal.SIGINT, -signal.SIGINT),
    "sigkill": ("single", "wait", signal.SIGKILL, -signal.SIGKILL),
    "a1e2-sigterm": ("a1e2", "wait", signal.SIGTERM, 128 + signal.SIGTERM),
    "a1e2-sigkill": ("a1e2", "wait", signal.SIGKILL, -signal.SIGKILL)}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_script_that_ends_leaves_no_process(ckpt, ending):
    deploy, mode, sig, status = ENDINGS[ending]
    p = subprocess.Popen([sys.executable, SCRIPT, ckpt, deploy, mode], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        info = json.loads(p.stdout.readline() or "null")
        assert info, p.communicate(timeout=30)
        assert p.stdout.readline().strip() == "GENERATING"
        if sig is not None:
            p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == status, err[-3000:]
    _assert_gone([info["mpiexec"], *info["ranks"]], info["address"])


def test_a_script_under_mpiexec_n1_starts_its_own_job(ckpt):
    """``mpiexec -n 1 python script.py`` asking for a1e2 (a launch of one process, not of the
    job's ranks) starts its own 3-rank child job, generates, and ends it with the script."""
    from mpi_util import run_mpi
    res = run_mpi(1, SCRIPT, [ckpt, "a1e2", "exit"], timeout=180)
    info = json.loads(res.stdout.splitlines()[0])
    assert len(info["ranks"]) == 3 and "GENERATING" in res.stdout
    _assert_gone([info["mpiexec"], *info["ranks"]], info["address"])
