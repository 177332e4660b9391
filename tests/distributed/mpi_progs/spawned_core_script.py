"""A plain ``python`` script that starts its ranks itself (``ChildJobClient``), for the tests of
how such a job ends; and the helpers those tests share (``job_tree``, ``Collector``).

    python spawned_core_script.py CKPT DEPLOY MODE

DEPLOY: ``single`` or ``a1e2``. Once the core is ready the script prints one JSON line
(``{"mpiexec": pid, "ranks": [pid, ...], "address": socket path}``), starts a long request,
waits for its first tokens, prints ``GENERATING`` and then, by MODE:
``exit``: returns without closing anything (interpreter exit ends the job);
``raise``: raises ``RuntimeError`` (uncaught);
``wait``: sleeps until a signal ends it (the test sends SIGTERM, SIGINT or SIGKILL).
"""
import json
import queue
import sys
import time

from megainfer.engine.resolve import JobTree
from megainfer.core_client.request_stream import Intake
from megainfer.engine_core.messages import AddRequest
from megainfer.engine.sampling_params import SamplingParams

# runtime_job.py's SCHED and CACHE (the single-mode reference's engine), as config keys
SCHEDULER = {"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 128}
CACHE = {"block_size": 4, "num_blocks": 256}
DEPLOYS = {"single": ({"mode": "single"}, 1),
           "a1e2": ({"mode": "disaggregated", "attention_replicas": 1, "attention_tp": 1,
                     "expert_ranks": 2}, 3)}


def job_tree(ckpt: str, deploy: str = "single", timeout_s: float = 10.0) -> JobTree:
    plan, world = DEPLOYS[deploy]
    return JobTree({"model": {"path": ckpt}, "deploy": dict(plan, cpu_threads=1),
                    "scheduler": dict(SCHEDULER), "cache": dict(CACHE),
                    "comm": {"timeout_s": timeout_s}}, world)


class Collector:
    """``deliver`` for a core: every ``CoreOutputs`` queued; ``until_done`` gathers tokens."""

    def __init__(self):
        self.queue = queue.Queue()

    def deliver(self, outputs) -> None:
        self.queue.put(outputs)

    def next(self, timeout: float = 60.0):
        """The next ``CoreOutputs`` (its error raised)."""
        out = self.queue.get(timeout=timeout)
        if out.error is not None:
            raise out.error
        return out

    def until_done(self, ids, timeout: float = 120.0) -> dict:
        """{request id: final RequestOutput} for every id in ``ids``."""
        done, end = {}, time.monotonic() + timeout
        while set(ids) - set(done):
            for u in self.next(max(0.1, end - time.monotonic())).updates:
                if u.output is not None:
                    done[u.request_id] = u.output
        return done

    def until_tokens(self, request_id: str, timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        while not any(u.request_id == request_id and u.new_tokens
                      for u in self.next(max(0.1, end - time.monotonic())).updates):
            pass


def add(core, intake: Intake, request_id: str, token_ids, **params) -> None:
    p = SamplingParams(**dict(dict(temperature=0.0, ignore_eos=True), **params))
    core.submit(AddRequest(request_id, intake.tokenize(None, p, token_ids), p))


def main():
    from megainfer.core_client.spawn import ChildJobClient
    ckpt, deploy, mode = sys.argv[1:4]
    spec = job_tree(ckpt, deploy)
    intake = Intake.for_job(spec.resolve(0))
    col = Collector()
    core = ChildJobClient(spec, col.deliver)
    print(json.dumps({"mpiexec": core.job.pid, "ranks": [r.pid for r in core.ranks],
                      "address": core.job.marker}), flush=True)
    add(core, intake, "long", [5, 6, 7], max_tokens=100)
    col.until_tokens("long")
    print("GENERATING", flush=True)
    if mode == "raise":
        raise RuntimeError("the script fails mid-generate")
    if mode == "wait":
        while True:
            time.sleep(0.1)
    assert mode == "exit", mode  # nothing closes the core: interpreter exit does


if __name__ == "__main__":
    main()
