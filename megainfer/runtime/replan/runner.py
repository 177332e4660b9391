"""Run a job whose attention:expert split may change while it runs (``replan.enabled``).

A job runs in phases. In each, the ranks run as at launch until rank 0 ends the loop: at the
job's end, or with a ``ReplanOrder`` from its ``ReplanController`` (a forced switch of
``replan.force_schedule``, or a decision of ``decider.decide`` every ``replan.interval``
iterations). Rank 0 then sends every rank the order (``tags.REPLAN_ORDER``; None: the job is
over), all switch (``switch.switch``) and the next phase starts. Rank 0 logs each re-plan and
keeps the list in ``Rank.replans``. ``REPLAN`` is how the feature plugs into the start-up
(``startup.py``) and, online, into rank 0's ``RuntimeEngine`` (``replan/online_plug.py``): there
the phases end between the engine core's iterations and the other ranks run ``_serve`` as in a
batch job. docs/replan.md, "Online (`LLM`, `AsyncLLM`, `megainfer-serve`;
`runtime/replan/online_plug.py`)"; "Visible" (what is logged)."""
from __future__ import annotations

import logging
import math
import os
import statistics
import time

from megainfer.config.replan import parse_plan
from megainfer.runtime import tags
from megainfer.runtime.messages import ReplanOrder
from megainfer.runtime.rank_parts import Feature
from megainfer.runtime.replan.measure import (ExpertReporter, attention_samples, comm_samples,
                                              records, take_events)
from megainfer.runtime.replan.switch import check_replan, switch
from megainfer.runtime.roles import expert_rank_ids

log = logging.getLogger("megainfer.runtime")
WINDOW = 16  # steps before / after a switch the measured gain compares
KEEP = 1024  # latest span samples a decision refits from


def run_replanning(r) -> None:
    """A rank other than 0: serve phases until the job is over (rank 0 drives them from its
    ``RuntimeEngine``, ``online_plug.py``)."""
    _serve(r)


def _auto(r) -> bool:
    return r.job.replan.measured


def _attach_reporter(r) -> None:
    """Measured decisions: this phase's sampler among the rank's expert hooks (the last
    phase's replaced; the others, e.g. the served runtime's span reports, kept)."""
    if r.worker is not None and _auto(r):
        job = r.job
        r.expert_hooks[:] = [h for h in r.expert_hooks if not isinstance(h, ExpertReporter)]
        r.expert_hooks.append(ExpertReporter(r.comm, r.tracer, job.replan.interval,
                                             job.trace.enabled))


def _serve(r) -> None:
    fresh = True
    while True:
        _attach_reporter(r)
        if r.loop is not None:
            r.loop.serve() if fresh else r.loop.resume()
        else:
            r.worker.run()
        fresh = False
        order = r.control.recv(0, tags.REPLAN_ORDER, "re-plan order (waiting for rank 0)")
        if order is None:
            return
        switch(r, order)


def order_switch(r, ctl: "ReplanController", order) -> None:
    """Rank 0: every rank gets ``order`` (``tags.REPLAN_ORDER``) and all switch to it,
    recorded; None: the job is over (every rank's ``_serve`` returns)."""
    for k in range(1, r.comm.Get_size()):
        r.control.send(order, k, tags.REPLAN_ORDER)
    if order is None:
        return
    ctl.switching(order)
    rec = switch(r, order)
    ctl.switched(rec)


def _tokens_per_s(clock) -> float:
    """Decode tokens per second over consecutive iteration syncs [(time, sequences running
    after that sync)]: each of them gains a token in the next iteration (prefill chunks aside)."""
    if len(clock) < 2 or clock[-1][0] <= clock[0][0]:
        return float("nan")
    return sum(n for _, n in clock[:-1]) / (clock[-1][0] - clock[0][0])


class ReplanController:
    """Rank 0's ``ReplicaLoop.replan_hook``: forced switches, or measured decisions."""

    def __init__(self, r):
        self.rank = r
        self.cfg = self.job.replan
        self.forced = list(self.cfg.force_schedule)
        self.records: list[dict] = r.replans
        self.decisions: list[dict] = r.replan_decisions  # every measured decision, switched or not
        self.ctx: dict = {}  # iteration -> mean computed length of rank 0's running sequences
        self.start = len(r.tracer.events)
        self.attn, self.expert, self.comm, self.slots = [], [], [], 1
        self.hw, self.shape = None, None
        self.clock: list = []  # per iteration: (perf_counter at its sync, sequences running)
        self.draining = False  # the engine core shuts down: no switch is ordered any more
        self.planned = None  # the live planner's order not carried out yet: (label, reason)

    @property
    def job(self):  # the plan in it changes at each switch
        return self.rank.job

    # ------------------------------------------------------------------ the hook
    def hook(self, loop, work: bool):
        it = loop.engine.executor.iteration
        plan = self.job.deploy
        cur = (plan.attention_replicas, plan.expert_ranks, plan.micro_batches)
        self.clock.append((time.perf_counter(), sum(v.running for v in loop.router.replicas)))
        if len(self.clock) > 2 * (WINDOW + 1):  # bounded (online it runs on): the last
            self._measure_last()  # switch's "after" is measured, the latest WINDOW kept
            del self.clock[:-(WINDOW + 1)]
        running = loop.engine.scheduler.running
        if not self.cfg.measured:  # forced switches or the live planner's: no measurements
            return self._ordered(it, cur, work)
        if running:  # what measured decisions sample
            self.ctx[it - 1] = sum(q.num_computed_tokens for q in running) / len(running)
        self.rank.tracer.enabled = self.job.trace.enabled or records(it, self.cfg.interval)
        if it % self.cfg.interval:
            return None
        self._collect(it)  # the expert ranks send their samples every interval: taken
        return self._decide(loop, it, cur) if work and not self.draining else None

    def order(self, label: str, reason: str) -> None:
        """The live planner's order (online, ``replan.policy=planner``): ``label`` ('a2e1m2')
        from the next iteration, idle or not (a newer order replaces one not carried out
        yet)."""
        a, e, _ = parse_plan(label) or (0, 0, None)
        world = self.rank.comm.Get_size()
        if a + e != world or e > self.job.model.num_experts:
            log.warning("[replan] planner order %r ignored: not a split of the %d ranks", label,
                        world)
            return
        self.planned = (label, reason)

    def _ordered(self, it: int, cur: tuple, work: bool):
        """A forced switch due at ``it`` (at an iteration with work), else the planner's order
        (at any iteration: an idle one is the cheapest to switch at); None while draining or
        with nothing ordered (once every forced switch is done too)."""
        if self.draining:
            return None
        if self.forced:
            if not work or self.forced[0][0] > it:
                return None
            (_, label), reason, kind = self.forced.pop(0), "forced", "forced"
        elif self.planned is not None:
            (label, why), self.planned = self.planned, None
            reason, kind = f"planner: {why}", "planner"
        else:
            return None
        a, e, m = parse_plan(label)
        new = (a, e, m or cur[2])
        if new == cur:
            log.info("[replan] %s switch at iteration %d: already %s", kind, it, label)
            return None
        return ReplanOrder(it, cur, new, reason, kind=kind)

    def _collect(self, it: int) -> None:
        ev, self.start = take_events(self.rank.tracer, self.start, self.job.trace.enabled)
        # a sliding window: a steady decode gives one batch size an interval, the fit needs two
        self.attn = (self.attn + attention_samples(ev, self.ctx))[-KEEP:]
        control, replies = self.rank.control, []
        experts = expert_rank_ids(self.job.deploy)
        for k in experts:
            got = control.recv(k, tags.REPLAN_SAMPLES, "re-plan samples")
            if got.iteration != it:
                raise RuntimeError(f"[replan] expert rank {k} reported iteration {got.iteration}, "
                                   f"rank 0 is at {it}")
            self.expert = (self.expert + got.samples)[-KEEP:]
            self.slots = got.slots_per_rank
            replies.append(got.reply_ends)
        self.comm = (self.comm + comm_samples(ev, replies, len(experts)))[-KEEP:]
        self.ctx = {i: c for i, c in self.ctx.items() if i >= it}

    def _decide(self, loop, it: int, cur: tuple):
        from megainfer.runtime.replan.decider import JobState, Measurements, decide
        hw, shape = self._model()
        router, sched = loop.router, loop.engine.scheduler
        views = router.replicas
        reqs = sched.queued()
        ctx = sum(q.num_tokens for q in reqs) / len(reqs) if reqs else 1
        left = [q.params.max_tokens - len(q.output_token_ids) for q in reqs]
        left += [getattr(p.params, "max_tokens", 16) or 16 for p in router.pending]
        state = JobState(sum(v.queue for v in views) + len(router.pending), max(1, int(ctx)),
                         max(1, int(sum(left) / len(left))) if left else 0,
                         self.job.scheduler.max_num_seqs, tuple(v.running for v in views))
        t_c = statistics.median(self.comm) if self.comm else float("nan")  # traced E2A
        meas = Measurements(tuple(self.attn), tuple(self.expert), self.slots, t_c)
        d = decide(meas, state, shape, hw, self.rank.comm.Get_size(), cur[:2], cur[2],
                   self.cfg.min_gain, self.cfg.link_gbps, self.job.load.dtype,
                   vary_m=self.cfg.micro_batches == "plan")
        log.info("[replan] iteration %d: %s; T_c %s", it, d.describe(),
                 f"{t_c * 1e3:.3g} ms traced" if self.comm else "not traced: the link model's")
        self.decisions.append(dict(iteration=it, switch=d.switch, best=d.label, gain=d.gain,
                                   reason=d.reason, attention_samples=len(self.attn),
                                   expert_samples=len(self.expert), t_c=t_c,
                                   comm_samples=len(self.comm)))
        if not d.switch:
            return None
        return ReplanOrder(it, cur, (*d.best, d.micro_batches[1]), f"measured: {d.reason}",
                           d.gain, kind="measured")

    def _model(self):
        if self.hw is None:
            from megainfer.perfmodel.model.hardware import load_hardware
            from megainfer.perfmodel.model.shapes import ModelShape
            from megainfer.perfmodel.model.weight_format import with_weight_format
            path = os.environ.get("MEGAINFER_HARDWARE_PROFILE")
            self.hw = load_hardware(path if path and os.path.isfile(path) else "cpu_node")
            ld = self.job.load  # weights move in their stored format (switch_cost)
            self.shape = with_weight_format(
                ModelShape.from_model_config(self.job.model, "replan_measured"),
                ld.quantization, ld.quantization_group_size, ld.path)
        return self.hw, self.shape

    # ------------------------------------------------------------------ records
    def switching(self, order) -> None:
        self._measure_last()  # the previous switch's "after" ends here
        self.before = _tokens_per_s(self.clock[-WINDOW - 1:])
        self.clock = []

    def switched(self, rec: dict) -> None:
        self._measure_last()
        self.expert, self.comm = [], []  # an expert rank now holds another number of slots
        rec["tokens_per_s_before"] = self.before
        self.records.append(rec)
        self.clock = []  # the switch itself is not an iteration of the new plan
        log.info("[replan] iteration %d: %s -> %s (%s), predicted gain %s, switch %.3f s, "
                 "expert weights moved %d bytes (%d slots), sequences handed over: %d with KV "
                 "(%d bytes), %d recomputed, %d not started (%d of them samples of n > 1 "
                 "requests)", rec["iteration"], rec["old"], rec["new"], rec["reason"],
                 "n/a" if math.isnan(rec["predicted_gain"]) else
                 f"{100 * rec['predicted_gain']:.1f}%", rec["seconds"], rec["weight_bytes"],
                 rec["weight_slots"], rec["move"], rec["kv_bytes"], rec["recompute"], rec["waiting"], rec["multi"])

    def _measure_last(self) -> None:
        if not self.records or "tokens_per_s_after" in self.records[-1]:
            return
        last = self.records[-1]
        after = _tokens_per_s(self.clock[:WINDOW + 1])
        last["tokens_per_s_after"] = after
        before = last["tokens_per_s_before"]  # 0 when nothing ran before the switch: no gain
        last["measured_gain"] = after / before - 1 if before > 0 else float("nan")

    def finish(self) -> None:
        self._measure_last()
        for rec in self.records:
            log.info("[replan] summary: iteration %d %s -> %s, switch %.3f s, measured gain %s",
                     rec["iteration"], rec["old"], rec["new"], rec["seconds"],
                     "n/a" if math.isnan(rec.get("measured_gain", float("nan")))
                     else f"{100 * rec['measured_gain']:.1f}%")


def _traced(job, role) -> bool:
    """Measured decisions (no forced schedule) sample rank 0's spans and the expert ranks'."""
    return job.replan.measured and (role.rank == 0 or not role.is_attention)


def _online(r):
    """Rank 0's plug into its ``RuntimeEngine`` (``runtime_engine.py``)."""
    from megainfer.runtime.replan.online_plug import OnlineReplanner
    return OnlineReplanner(r)


REPLAN = Feature("replan", wants=lambda job: job.replan.enabled, check=check_replan,
                 traced=_traced, run=run_replanning, online=_online)
