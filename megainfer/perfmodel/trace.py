"""Write and read the pipeline trace format (docs/trace_format.md): Chrome trace-event JSON."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

LANES = {"disaggregated": ("attention", "A2E", "expert", "E2A"),
         "colocated": ("attention", "dispatch", "expert", "combine")}
_SHORT = {"attention": "attn", "A2E": "A2E", "expert": "expert", "E2A": "E2A",
          "dispatch": "dispatch", "combine": "combine"}


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
        self.events.append({
            "ph": "X", "name": f"{_SHORT[cat]} L{layer} mb{mb}", "cat": cat, "pid": pid,
            "tid": LANES[self.mode].index(cat), "ts": round(start_s * 1e6, 3),
            "dur": round(max(0.0, end_s - start_s) * 1e6, 3),
            "args": {"iter": it, "layer": layer, "mb": mb, "tokens": int(round(tokens))}})

    def to_dict(self, plan: dict | None = None) -> dict:
        meta = []
        for pid, name in sorted(self.names.items()):
            meta.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
            for tid, lane in enumerate(LANES[self.mode]):
                meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                             "args": {"name": lane}})
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms",
                "metadata": {"source": self.source, "mode": self.mode, "plan": plan or {}}}

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
