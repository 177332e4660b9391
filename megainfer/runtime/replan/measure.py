"""What a re-planning decision is made from: the layer spans the ranks traced since the last
decision (docs/replan.md, docs/trace_format.md).

* attention (rank 0's own MoE attention spans): ``(tokens, mean context, seconds)``;
* experts (each expert rank's ``expert`` spans, sent to rank 0 as ``messages.ExpertSamples``):
  ``(token-expert pairs, seconds)``;
* T_c: rank 0's ``E2A`` wait for a (iteration, layer, micro-batch) against the moment the last
  expert rank's reply left, when rank 0 was already waiting (one trace clock); the median is
  the decision's ``t_c``.

With ``trace.enabled=false`` only the last ``SAMPLE_ITERS`` iterations before each decision are
recorded and their events dropped once read, so memory stays bounded."""
from __future__ import annotations

from mpi4py import MPI

from megainfer.perfmodel.trace import E2A, EXPERT, is_moe_attention
from megainfer.runtime import tags
from megainfer.runtime.control import Outbox
from megainfer.runtime.messages import ExpertSamples
SAMPLE_ITERS = 4  # iterations recorded before each decision (all of them with trace.enabled)


def records(iteration: int, interval: int) -> bool:
    """Whether ``iteration`` is among the last ``SAMPLE_ITERS`` before a decision (at a
    multiple of ``interval``): spans are recorded only then, so a steady job pays for a few
    iterations' tracing an interval, not every iteration's."""
    return iteration % interval >= interval - min(SAMPLE_ITERS, interval)


def take_events(tracer, start: int, keep: bool) -> tuple[list, int]:
    """Complete events recorded since index ``start``; returns them and the next start."""
    tracer.resolve()
    ev = tracer.events[start:]
    if keep:
        return ev, len(tracer.events)
    tracer.events = []
    return ev, 0


def attention_samples(events: list, ctx_of_iter: dict) -> list:
    out = []
    for e in events:
        a = e.get("args", {})
        if is_moe_attention(e) and a.get("tokens", 0) > 0:
            ctx = ctx_of_iter.get(a["iter"])
            if ctx:
                out.append((a["tokens"], ctx, e["dur"] / 1e6))
    return out


def expert_samples(events: list, pairs_of_iter: dict) -> list:
    rows: dict = {}
    spans = [e for e in events if e["cat"] == EXPERT and e["args"].get("tokens", 0) > 0]
    for e in spans:
        rows[e["args"]["iter"]] = rows.get(e["args"]["iter"], 0) + e["args"]["tokens"]
    out = []
    for e in spans:
        it, n = e["args"]["iter"], e["args"]["tokens"]
        if pairs_of_iter.get(it) and rows.get(it):
            out.append((n * pairs_of_iter[it] / rows[it], e["dur"] / 1e6))
    return out


def reply_ends(events: list) -> list:
    """An expert rank's ``(iteration, layer, micro-batch, end us)`` per reply (``E2A`` span)."""
    return [(e["args"]["iter"], e["args"]["layer"], e["args"]["mb"], e["ts"] + e["dur"])
            for e in events if e["cat"] == E2A]


def comm_samples(events: list, replies: list, expert_ranks: int) -> list:
    """Rank 0's events + every expert rank's ``reply_ends`` (one list per rank) -> one-way E2A
    seconds, one per (iteration, layer, micro-batch) that every expert rank answered while rank 0
    was waiting."""
    last: dict = {}
    count: dict = {}
    for per_rank in replies:
        for it, layer, mb, end in per_rank:
            k = (it, layer, mb)
            last[k] = max(last.get(k, end), end)
            count[k] = count.get(k, 0) + 1
    out = []
    for e in events:
        if e["cat"] != E2A:
            continue
        a = e["args"]
        k = (a["iter"], a["layer"], a["mb"])
        if count.get(k) != expert_ranks:
            continue
        end = e["ts"] + e["dur"]
        if e["ts"] < last[k] < end:
            out.append((end - last[k]) / 1e6)
    return out


class ExpertReporter:
    """One of an expert rank's ``Rank.expert_hooks``: every ``interval`` iterations, its
    samples since the last report go to rank 0 (non-blocking; rank 0 takes them at the same
    iteration's decision)."""

    def __init__(self, comm: MPI.Comm, tracer, interval: int, keep_events: bool):
        self.comm, self.tracer, self.interval, self.keep = comm, tracer, interval, keep_events
        self.start, self.outbox = len(tracer.events), Outbox(comm)

    def __call__(self, worker) -> None:
        self.tracer.enabled = self.keep or records(worker.iteration, self.interval)
        if worker.iteration % self.interval:
            return
        reb = worker.rebalancer
        first = worker.iteration - len(reb.tokens_per_iteration)
        pairs = {first + i: n for i, n in enumerate(reb.tokens_per_iteration)}
        ev, self.start = take_events(self.tracer, self.start, self.keep)
        samples = expert_samples(ev, pairs)
        msg = ExpertSamples(worker.iteration, samples, reb.placement.slots_per_rank, reply_ends(ev))
        self.outbox.post(msg, 0, tags.REPLAN_SAMPLES)
