"""Per-rank pipeline traces in the Chrome/Perfetto format of ``docs/trace_format.md``."""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

LANES = {"disaggregated": ("attention", "A2E", "expert", "E2A"),
         "colocated": ("attention", "dispatch", "expert", "combine")}


class Tracer:
    """Records complete events ("ph": "X") on named lanes; one clock per job (``epoch``)."""

    def __init__(self, enabled: bool = False, rank: int = 0, name: str = "", mode: str = "disaggregated",
                 epoch: float = 0.0):
        self.enabled, self.rank, self.name, self.mode = enabled, rank, name, mode
        self.lanes = LANES[mode]
        self.epoch = epoch or time.perf_counter()
        self.events: list[dict] = []

    def now_us(self) -> float:
        return (time.perf_counter() - self.epoch) * 1e6

    @contextmanager
    def span(self, lane: str, name: str, iteration: int, layer: int, mb: int, tokens: int):
        if not self.enabled:
            yield
            return
        t0 = self.now_us()
        try:
            yield
        finally:
            self.add(lane, name, t0, self.now_us() - t0, iteration, layer, mb, tokens)

    def add(self, lane, name, ts_us, dur_us, iteration, layer, mb, tokens) -> None:
        if self.enabled:
            self.events.append({"ph": "X", "name": name, "cat": lane, "pid": self.rank,
                                "tid": self.lanes.index(lane), "ts": round(ts_us, 3),
                                "dur": round(max(dur_us, 0.0), 3),
                                "args": {"iter": iteration, "layer": layer, "mb": mb, "tokens": tokens}})

    def to_json(self) -> dict:
        meta = [{"ph": "M", "name": "process_name", "pid": self.rank, "args": {"name": self.name}}]
        meta += [{"ph": "M", "name": "thread_name", "pid": self.rank, "tid": t, "args": {"name": n}}
                 for t, n in enumerate(self.lanes)]
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms",
                "metadata": {"source": "runtime", "mode": self.mode}}

    def write(self, directory: str) -> str:
        path = os.path.join(directory, f"trace.rank{self.rank}.json")
        with open(path, "w") as f:
            json.dump(self.to_json(), f)
        return path


def merge_traces(paths: list[str], out: str, metadata: dict | None = None) -> str:
    """Concatenate per-rank trace files into one (rank 0 does this at the end of a job)."""
    events, meta = [], {"source": "runtime"}
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        events += d["traceEvents"]
        meta.update(d.get("metadata", {}))
    meta.update(metadata or {})
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms", "metadata": meta}, f)
    return out
