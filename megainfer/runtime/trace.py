"""Per-rank pipeline traces in the Chrome/Perfetto format of ``docs/trace_format.md``; the lanes,
span names and event dicts are the format's own (``megainfer.perfmodel.trace``, pure), shared
with the simulators."""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

import torch

from megainfer.perfmodel.trace import LANES, complete_event, rank_metadata, trace_document


class Tracer:
    """Records complete events ("ph": "X") on named lanes; one clock per job (``epoch``).

    On a CUDA ``device`` a span is timed by two CUDA events on the current stream (when the
    device reached its start and its end, not when the host queued them): nothing waits while
    recording; at ``to_json`` the events are read once and placed on the host clock through an
    anchor event recorded at construction (whose host time is taken after synchronising it).
    ``add`` (host-timed waits, e.g. an expert rank's receive) stays on the host clock."""

    def __init__(self, enabled: bool = False, rank: int = 0, name: str = "", mode: str = "disaggregated",
                 epoch: float = 0.0, device=None):
        self.enabled, self.rank, self.name, self.mode = enabled, rank, name, mode
        self.lanes = LANES[mode]
        self.epoch = epoch or time.perf_counter()
        self.events: list[dict] = []
        self.cuda = enabled and device is not None and torch.device(device).type == "cuda"
        self._pending: list = []  # (event dict, start CUDA event, end CUDA event)
        if self.cuda:
            self._anchor = torch.cuda.Event(enable_timing=True)
            self._anchor.record()
            self._anchor.synchronize()
            self._anchor_us = self.now_us()

    def now_us(self) -> float:
        return (time.perf_counter() - self.epoch) * 1e6

    @contextmanager
    def span(self, lane: str, name: str, iteration: int, layer: int, mb: int, tokens: int):
        if not self.enabled:
            yield
            return
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            try:
                yield
            finally:
                end.record()
                self.add(lane, name, 0.0, 0.0, iteration, layer, mb, tokens)
                self._pending.append((self.events[-1], start, end))
            return
        t0 = self.now_us()
        try:
            yield
        finally:
            self.add(lane, name, t0, self.now_us() - t0, iteration, layer, mb, tokens)

    def add(self, lane, name, ts_us, dur_us, iteration, layer, mb, tokens) -> None:
        if self.enabled:
            if lane not in self.lanes:  # an extra lane (KV transfers, docs/pd.md)
                self.lanes = (*self.lanes, lane)
            self.events.append(complete_event(self.rank, lane, self.lanes.index(lane), name,
                                              ts_us, dur_us, iteration, layer, mb, tokens))

    def resolve(self) -> None:
        """Device-timed spans -> host-clock ts/dur (waits once for their last event)."""
        if not self._pending:
            return
        torch.cuda.synchronize()
        for ev, start, end in self._pending:
            ev["ts"] = round(self._anchor_us + self._anchor.elapsed_time(start) * 1e3, 3)
            ev["dur"] = round(max(start.elapsed_time(end) * 1e3, 0.0), 3)
        self._pending = []

    def to_json(self) -> dict:
        self.resolve()
        return trace_document(rank_metadata(self.rank, self.name, self.lanes) + self.events,
                              {"source": "runtime", "mode": self.mode})

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
        json.dump(trace_document(events, meta), f)
    return out
