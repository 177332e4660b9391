"""The pipeline's T_e and T_c while a runtime serves (trace.enabled=true, cpu): the expert ranks'
spans reach rank 0 as the job runs, not only in the trace merged at a batch job's end.

* ``ExpertSpanReporter`` (one of a rank's ``Rank.expert_hooks``): every
  ``REPORT_EVERY`` iterations its new ``expert`` spans (T_e) and its A2E receive waits go to
  rank 0 as one ``messages.ExpertSpans`` (``tags.SERVE_SPANS``; a small message, sent
  eagerly, so no request is left open when the rank finalizes).
* ``PipelineSpans`` (rank 0): its own MoE attention spans (T_a), and whatever ``ExpertSpans``
  arrived (``iprobe``: never waits, so a report one iteration late costs nothing); T_c as
  ``runtime/trace_metrics.py`` defines it: a blocked expert rank's wait end minus rank 0's
  dispatch end of the same (iteration, layer, micro-batch), on the job's trace clock.

Every runtime job with tracing on attaches them (``engine_core.builder.build_ranks``; a batch
job also merges every rank's whole trace at its end). Spans on cuda are known only when the
trace is resolved (a device sync): neither runs there.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from megainfer.perfmodel.trace import A2E, EXPERT, is_moe_attention, is_wait
from megainfer.runtime import tags
from megainfer.runtime.messages import ExpertSpans

REPORT_EVERY = 4  # expert iterations per report
KEEP_DISPATCHES = 4096  # rank 0's latest dispatch ends kept for matching late reports


def _key(e: dict) -> tuple:
    a = e["args"]
    return a["iter"], a["layer"], a["mb"]


class ExpertSpanReporter:
    """Reads the rank's communicator and tracer at each report (a re-plan replaces the first
    and may clear the second's events)."""

    def __init__(self, rank, every: int = REPORT_EVERY):
        self.rank, self.every = rank, every
        self.seen = len(rank.tracer.events)

    def __call__(self, worker) -> None:
        if worker.iteration % self.every:
            return
        comm, tracer = self.rank.comm, self.rank.tracer
        if self.seen > len(tracer.events):  # cleared since
            self.seen = 0
        events = tracer.events[self.seen:]
        self.seen = len(tracer.events)
        msg = ExpertSpans(comm.Get_rank(),
                          [e["dur"] / 1e6 for e in events if e["cat"] == EXPERT],
                          [(_key(e), e["ts"] + e["dur"]) for e in events
                           if e["cat"] == A2E and is_wait(e) and e["dur"] > 0])
        self.rank.control.send(msg, 0, tags.SERVE_SPANS)  # a few KB: completes at once (eager)


@dataclass
class SpanSamples:
    """Seconds: T_a spans of rank 0, T_e spans of the expert ranks, T_c one-way latencies."""

    attention_s: list[float] = field(default_factory=list)
    expert_s: list[float] = field(default_factory=list)
    comm_s: list[float] = field(default_factory=list)


class PipelineSpans:
    """Rank 0's reader: ``take()`` -> the ``SpanSamples`` since the last call."""

    def __init__(self, rank):
        self.comm, self.tracer, self.seen = rank.comm, rank.tracer, len(rank.tracer.events)
        self.dispatch_end: dict = {}  # (iteration, layer, mb) -> rank 0's dispatch end, us

    def take(self) -> SpanSamples:
        out = SpanSamples()
        events = self.tracer.events[self.seen:]
        self.seen = len(self.tracer.events)
        for e in events:
            if is_moe_attention(e):
                out.attention_s.append(e["dur"] / 1e6)
            elif e["cat"] == A2E and not is_wait(e):
                self.dispatch_end[_key(e)] = e["ts"] + e["dur"]
        excess = len(self.dispatch_end) - KEEP_DISPATCHES
        if excess > 0:  # the oldest: a dict keeps the order they were recorded in
            for k in list(itertools.islice(self.dispatch_end, excess)):
                del self.dispatch_end[k]
        while self.comm.iprobe(tag=tags.SERVE_SPANS):
            msg: ExpertSpans = self.comm.recv(tag=tags.SERVE_SPANS)
            out.expert_s += msg.expert_s
            for k, end in msg.arrivals:
                sent = self.dispatch_end.get(tuple(k))
                if sent is not None and end > sent:
                    out.comm_s.append((end - sent) / 1e6)
        return out
