"""The pipeline trace format (docs/trace_format.md): Chrome trace-event JSON, and its vocabulary.

One owner for what the runtime (``runtime/trace.py``) and the simulators write and what every
reader (``runtime/trace_metrics.py``, ``model/insitu.py``, ``timeline_plot.py``) matches on:
the lanes of a rank per mode (their order is the ``tid``), the extra lanes appended when first
used, every span's name (``span_name``, ``dense_name``, ``wait_name``, ``prefill_step_name``,
``kv_transfer_name``, ``replan_name``), the filters on them and the event dicts themselves.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

# Lanes (a span's "cat"; the lane's index in LANES[mode] is its "tid").
ATTENTION, EXPERT = "attention", "expert"
A2E, E2A = "A2E", "E2A"  # disaggregated: attention -> experts, experts -> attention
DISPATCH, COMBINE = "dispatch", "combine"  # colocated: the all-to-alls inside the group
LANES = {"disaggregated": (ATTENTION, A2E, EXPERT, E2A),
         "colocated": (ATTENTION, DISPATCH, EXPERT, COMBINE)}
# Extra lanes, appended to a rank's lanes as they first appear (docs/pd.md, docs/replan.md).
PREFILL, KV_SEND, KV_RECV, REPLAN = "prefill", "KV send", "KV recv", "replan"

# A span's name: "<prefix> L<layer> mb<mb>"; an attention span of an MoE layer is "attn ...",
# a dense layer's "dense ..."; a receiver blocked on a lane: "<lane> wait L<layer> mb<mb>";
# the extra lanes' spans: "prefill step <n>", "KV <request id>", "replan <aNeM>".
ATTN, DENSE, WAIT, KV = "attn", "dense", "wait", "KV"
_PREFIX = {ATTENTION: ATTN, A2E: A2E, EXPERT: EXPERT, E2A: E2A, DISPATCH: DISPATCH,
           COMBINE: COMBINE}


def span_name(lane: str, layer: int, mb: int) -> str:
    return f"{_PREFIX[lane]} L{layer} mb{mb}"


def dense_name(layer: int, mb: int) -> str:
    """The attention lane's span of a dense (not MoE) layer: no expert exchange follows it."""
    return f"{DENSE} L{layer} mb{mb}"


def wait_name(lane: str, layer: int, mb: int) -> str:
    return f"{lane} {WAIT} L{layer} mb{mb}"


def prefill_step_name(step: int) -> str:
    """A prefill rank's step (lane ``PREFILL``)."""
    return f"{PREFILL} step {step}"


def kv_transfer_name(request_id) -> str:
    """One request's KV transfer, on the sender's ``KV_SEND`` and the receiver's ``KV_RECV``."""
    return f"{KV} {request_id}"


def replan_name(label: str) -> str:
    """A re-plan's switch to the split ``label`` (``aNeM``; lane ``REPLAN``)."""
    return f"{REPLAN} {label}"


def is_moe_attention(event: dict) -> bool:
    """An attention span of an MoE layer (what T_a is read from; dense layers excluded)."""
    return event["cat"] == ATTENTION and event["name"].startswith(ATTN)


def is_wait(event: dict) -> bool:
    """A span of a rank blocked on its lane (``wait_name``), not the transfer itself."""
    return event["name"].startswith(f"{event['cat']} {WAIT}")


def complete_event(pid: int, lane: str, tid: int, name: str, ts_us: float, dur_us: float,
                   iteration: int, layer: int, mb: int, tokens) -> dict:
    """One span ("ph": "X"), times in microseconds on the job's clock."""
    return {"ph": "X", "name": name, "cat": lane, "pid": pid, "tid": tid, "ts": round(ts_us, 3),
            "dur": round(max(dur_us, 0.0), 3),
            "args": {"iter": iteration, "layer": layer, "mb": mb, "tokens": tokens}}


def rank_metadata(pid: int, name: str, lanes) -> list[dict]:
    """The process name of a rank and the thread names of its lanes."""
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}]
    meta += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": n}}
             for t, n in enumerate(lanes)]
    return meta


def trace_document(events: list, metadata: dict) -> dict:
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata}


@dataclass
class TraceWriter:
    """Collects complete events (times in seconds) and writes trace-event JSON (microseconds)."""

    mode: str = "disaggregated"
    source: str = "simulator"
    events: list = field(default_factory=list)
    names: dict = field(default_factory=dict)  # pid -> process name

    def process(self, pid: int, name: str) -> None:
        self.names[pid] = name

    def name_ranks(self, n_a: int, tp_a: int, n_e: int, tp_e: int) -> None:
        """Name every rank of a disaggregated layout as the runtime's logs do (rank order:
        attention replica-major, then expert ranks, each ``tp_e`` wide)."""
        for a in range(n_a):
            for t in range(tp_a):
                self.process(a * tp_a + t, f"[attn dp{a} tp{t}]")
        for r in range(n_e):
            for t in range(tp_e):
                self.process(n_a * tp_a + r * tp_e + t,
                             f"[expert {r}]" + (f" tp{t}" if tp_e > 1 else ""))

    def span(self, pid: int, cat: str, start_s: float, end_s: float, it: int, layer: int, mb: int,
             tokens: float) -> None:
        self.events.append(complete_event(pid, cat, LANES[self.mode].index(cat),
                                          span_name(cat, layer, mb), start_s * 1e6,
                                          (end_s - start_s) * 1e6, it, layer, mb,
                                          int(round(tokens))))

    def to_dict(self, plan: dict | None = None) -> dict:
        meta = [m for pid, name in sorted(self.names.items())
                for m in rank_metadata(pid, name, LANES[self.mode])]
        return trace_document(meta + self.events,
                              {"source": self.source, "mode": self.mode, "plan": plan or {}})

    def write(self, path: str, plan: dict | None = None) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(plan), f)


def read_trace(path: str) -> dict:
    """Load a trace file; returns {'events': [X events], 'names': {pid: name}, 'metadata': {...}}."""
    with open(path) as f:
        d = json.load(f)
    evs = d["traceEvents"] if isinstance(d, dict) else d
    names = {e["pid"]: e["args"]["name"] for e in evs
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    xs = [e for e in evs if e.get("ph") == "X"]
    return {"events": xs, "names": names, "metadata": d.get("metadata", {}) if isinstance(d, dict) else {}}
