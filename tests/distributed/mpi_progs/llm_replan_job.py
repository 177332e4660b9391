"""``LLM(deploy=...)`` / ``AsyncLLM(deploy=...)`` re-planning online under mpiexec: forced
switches (``replan.force_schedule``) while the engine core serves; rank 0 dumps JSON.

    mpiexec -n K python llm_replan_job.py OUT.json CKPT DEPLOY {offline|async} FORCE [OVERRIDE ...]

DEPLOY: a conf/deploy preset name or a JSON mapping of ``deploy.*`` keys. FORCE: the schedule
as JSON (``[[iteration, "aNeM"], ...]``). ``offline``: llm_deploy_job's
``offline_outputs`` (greedy, seeded n=2, logprobs, stop strings, chat) with the switches
falling inside them, then the idle CPU of every rank. ``async``: ``switch_outputs`` (long
streams; at each of the first two switches, held ordered (``hold_switches``), an abort of a
running request,
a request that arrives and one that arrives and is aborted at once; ``IN_ORDER_SYNC`` aborted
inside the iteration whose sync orders the third), then llm_deploy_job's
``async_outputs`` (streams, aborts, arrivals) on the plan the switches left. Both record rank
0's re-plans (``RuntimeEngine.replans``)."""
import asyncio
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

from abort_on_error import run_or_abort  # noqa: E402
from llm_deploy_job import ENGINE_ARGS, _stream, async_outputs, offline_outputs, prompts  # noqa: E402

LONG = dict(temperature=0, max_tokens=40, ignore_eos=True)
VICTIMS = {1: "a5", 2: "a4"}  # aborted at switch k; from a1e2 both change replica there
IN_ORDER_SYNC = "a3"  # aborted inside the sync whose hook orders the third switch
POLL_S = 0.001


def switch_requests(vocab: int) -> dict:
    """{request id: (prompt token ids, SamplingParams kwargs)} of ``switch_outputs`` (the
    reference runs them in single mode)."""
    ps = prompts(vocab)
    reqs = {f"a{i}": (ps[i], LONG) for i in range(6)}
    for k in (1, 2):
        reqs[f"b{k}"] = (ps[k + 2], dict(temperature=0, max_tokens=10 + k, ignore_eos=True))
        reqs[f"c{k}"] = (ps[k + 4], LONG)
    return reqs


async def _until(cond, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"waited {timeout}s for {what}")
        await asyncio.sleep(POLL_S)


def hold_switches(count: int) -> list:
    """Rank 0's first ``count`` switches wait, ordered but before any rank switches, until
    their gate opens (the other ranks wait for the order meanwhile, within comm.timeout_s):
    what the test does then happens during the switch however short the switch is."""
    from megainfer.runtime.replan import online_plug as online
    gates, held = [threading.Event() for _ in range(count)], []
    switch = online.order_switch

    def gated(r, ctl, order):
        if order is not None and len(held) < count:
            held.append(order)
            gates[len(held) - 1].wait(60)
        switch(r, ctl, order)
    online.order_switch = gated
    return gates


async def switch_outputs(engine, rt, gates) -> dict:
    """Streams across the first two switches; during each (held at its gate): an abort of a
    running request (``VICTIMS``), a new request, a new request aborted at once."""
    from megainfer import SamplingParams
    reqs = switch_requests(engine.job.model.vocab_size)
    tasks = {}

    def start(rid):
        p, kw = reqs[rid]
        tasks[rid] = asyncio.create_task(_stream(engine, rid, p, SamplingParams(**kw)))
    for i in range(6):
        start(f"a{i}")
    during = []
    for k in (1, 2):
        await _until(lambda: rt.switching, 120, f"switch {k}")
        await engine.abort(VICTIMS[k])  # running, on a replica that may move
        start(f"b{k}")
        start(f"c{k}")
        await asyncio.sleep(0.01)  # its AddRequest queued before the abort
        await engine.abort(f"c{k}")
        during.append(rt.switching)  # the actions were queued while it still ran
        gates[k - 1].set()
        await _until(lambda: len(rt.replans) >= k and not rt.switching, 120, f"switch {k} end")
    got = dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 120)))
    return {"streams": got, "during": during}


def abort_in_order_sync(rt, victim: str, nth: int) -> None:
    """Rank 0's hook ending the ``nth`` phase first aborts ``victim`` (as if its abort had
    come during that iteration): the abort must outlive the switch that follows."""
    hook, orders = rt.loop.replan_hook, []

    def hooked(loop, work):
        order = hook(loop, work)
        if order is not None:
            orders.append(order)
            if len(orders) == nth:
                loop.abort(victim)
        return order
    rt.loop.replan_hook = hooked  # a switch's new loop keeps it


def count_new_tokens(rt) -> dict:
    """{request id: tokens its samples got as new tokens}, counted from every iteration of
    rank 0's engine from now on (what streams are built of: none lost, none repeated)."""
    counts: dict = {}
    step = rt.step_outputs

    def counted():
        res = step()
        for d in res.new_tokens:
            counts[d.request_id] = counts.get(d.request_id, 0) + len(d.token_ids)
        return res
    rt.step_outputs = counted  # the engine core looks it up at each iteration
    return counts


def unwrapped(engine):
    """Rank 0's ``RuntimeEngine`` (the engine core holds it as it is)."""
    return getattr(engine, "_engine", engine)


def runtime_engine(llm):
    """Rank 0's ``RuntimeEngine`` under an ``LLM`` (the engine of its in-process core)."""
    return unwrapped(llm.engine)


def main():
    from mpi4py import MPI
    pids = MPI.COMM_WORLD.allgather(os.getpid())  # before LLM(...): only rank 0 leaves it
    out, ckpt, deploy, what, force = sys.argv[1:6]
    deploy = json.loads(deploy) if deploy.startswith("{") else deploy
    overrides = ["comm.timeout_s=30", "replan.enabled=true",
                 f"replan.force_schedule={force}", *sys.argv[6:]]
    if what == "offline":
        from megainfer import LLM
        llm = LLM(ckpt, deploy=deploy, overrides=overrides, **ENGINE_ARGS)
        rt = runtime_engine(llm)
        got = offline_outputs(llm)
        from megainfer.bench.process_cpu import idle_cpu
        got["idle_cpu"] = idle_cpu(pids, 2.0)
    else:
        from megainfer import AsyncLLM
        llm = AsyncLLM(ckpt, deploy=deploy, overrides=overrides, **ENGINE_ARGS)
        rt = unwrapped(llm.engine)
        counts = count_new_tokens(rt)
        abort_in_order_sync(rt, IN_ORDER_SYNC, 3)
        got = asyncio.run(switch_outputs(llm, rt, hold_switches(2)))
        got["after"] = async_outputs(llm)
        t0 = time.monotonic()  # every replica's blocks back (prefix caching off): the last
        while rt.load().kv_usage > 0 and time.monotonic() - t0 < 10:  # statuses say so
            time.sleep(0.05)
        load = rt.load()
        got["idle_load"] = [load.running, load.waiting, load.not_handed_out, load.kv_usage]
        got["new_tokens"] = counts
    got["replans"] = [[r["old"], r["new"], r["move"] + r["recompute"] + r["waiting"], r["move"],
                       r["recompute"], r["seconds"]] for r in rt.replans]
    got["decisions"] = [[d["iteration"], d["switch"]] for d in rt.rank.replan_decisions]
    got["plan"] = [rt.rank.job.deploy.attention_replicas, rt.rank.job.deploy.expert_ranks]
    llm.close() if what == "offline" else llm.shutdown()
    with open(out, "w") as f:
        json.dump(got, f)


if __name__ == "__main__":
    run_or_abort(main)
