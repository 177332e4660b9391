"""The pipeline's T_e and T_c while a runtime serves (trace.enabled=true, cpu): the expert ranks'
spans reach rank 0 as the job runs, not only in the trace merged at a batch job's end.

* ``ExpertSpanReporter`` (one of ``Rank.expert_hooks``): every ``REPORT_EVERY`` iterations its
  new ``expert`` spans (T_e) and A2E receive waits go to rank 0 as one ``messages.ExpertSpans``
  (``tags.SERVE_SPANS``, small and sent eagerly: no request open when the rank finalizes).
* ``PipelineSpans`` (rank 0): its own MoE attention spans (T_a) and whatever ``ExpertSpans``
  arrived (``iprobe``: never waits); T_c as ``runtime/trace_metrics.py`` defines it.
* The end: once the job is over each reporting rank sends one ``last`` report
  (``send_last_report``) and rank 0's ``close`` receives every report up to it (same source,
  tag and communicator: MPI matches them in order). A report left unreceived at rank 0 makes
  MPICH's ``MPI_Finalize`` fail ("being freed has unmatched messages"); the rank then leaves
  without telling the process manager, and mpiexec SIGKILLs the job's other ranks.

Spans on cuda are known only when the trace is resolved (a device sync): neither runs there.
docs/serve.md, "Metrics (`GET /metrics`)"."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import logging

from megainfer.perfmodel.trace import A2E, EXPERT, is_moe_attention, is_wait
from megainfer.runtime import tags
from megainfer.runtime.control import RankFailure
from megainfer.runtime.messages import ExpertSpans

log = logging.getLogger("megainfer.runtime")

REPORT_EVERY = 4  # expert iterations per report
KEEP_DISPATCHES = 4096  # rank 0's latest dispatch ends kept for matching late reports


def reports_spans(job, role, tracer) -> bool:
    """Whether this rank sends its expert spans to rank 0: a rank of rank 0's communicator
    (not rank 0; a PD prefill rank is in a communicator of its own) with tracing on, on cpu.
    A re-plan may make any such rank an expert rank, so each reports from the start."""
    return role.rank != 0 and not role.is_prefill and job.trace.enabled and not tracer.cuda


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

    def send_last(self) -> None:
        """The job is over: the report rank 0 waits for before it finalizes (no spans: nobody
        reads them now); this rank sends no more."""
        self.rank.control.send(ExpertSpans(self.rank.comm.Get_rank(), last=True), 0,
                               tags.SERVE_SPANS)


def send_last_report(rank) -> None:
    """A rank other than 0 whose job ended well: its reporter's last report, if it has one."""
    for hook in rank.expert_hooks:
        if isinstance(hook, ExpertSpanReporter):
            hook.send_last()


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
        self.control = rank.control
        self.reporters = rank.job.trace.enabled  # every other rank reports (``reports_spans``)
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

    def close(self) -> None:
        """Every rank stopped: receive each reporting rank's reports up to its ``last`` (each
        wait bounded by the control plane's policy; a rank that stays silent is logged and
        left: the job ends anyway)."""
        if not self.reporters:
            return
        for k in range(1, self.comm.Get_size()):
            try:
                while not self.control.recv(k, tags.SERVE_SPANS, "the last span report").last:
                    pass
            except RankFailure as e:
                log.warning("%s", e)
