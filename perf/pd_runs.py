"""The recorded PD bench runs (``perf/bench_pd.py`` → ``perf/results/bench_pd*.json``) as
perf/validate_sim_pd.py reads them: with each launch's spans, which were made with the idle
decode pool sleeping, which on a machine running nothing else, and how far a simulated figure
lies from its launches."""
from __future__ import annotations

import gzip
import json
import os

import numpy as np

import pd_trace_stats as pts

IDLE_FIX = "2026-12-01T01:15:27+00:00"  # from then on an idle PD decode pool sleeps (docs/pd.md)


def sleeps_when_idle(d: dict) -> bool:
    """Whether a bench result was measured with a decode pool that sleeps while it has nothing
    to decode (idle_decode_busy 0); earlier runs stepped empty iterations."""
    return bool(d.get("date")) and d["date"] >= IDLE_FIX


def others_ran(d: dict) -> bool:
    """Whether other tenants shared the machine with a run: a launch's 1-min load average above
    the job's own ranks (a job of R ranks alone cannot load the machine more; the loaded runs
    read 4.2-8.5, the quiet ones 2.0-3.2), or no load average recorded."""
    loads = [r.get("load_average") for r in d["rows"]]
    return any(x is None for x in loads) or max(loads) > d["args"]["ranks"]


def is_quiet(d: dict) -> bool:
    """A run on a machine running nothing but it: probed (``--calibrate``), measured after
    ``IDLE_FIX`` (the decode pool sleeping) and no other tenants (``others_ran``)."""
    return bool(d.get("calibrations")) and sleeps_when_idle(d) and not others_ran(d)


def with_spans(path: str) -> dict:
    """A bench result with each launch's spans (``bench_pd.py --trace``'s .spans.json.gz)
    attached."""
    with open(path) as f:
        d = json.load(f)
    sp = pts.spans_path(path)
    if os.path.isfile(sp):
        with gzip.open(sp, "rt") as f:
            spans = json.load(f)
        for row in d["rows"]:
            for r, x in zip(row.get("runs", []), spans.get(f"{row['workload']}/{row['layout']}", [])):
                r["spans"] = x
    return d


def beyond(x: float, lo: float, hi: float) -> float:
    """How far ``x`` lies outside the launches' range [lo, hi], relative to the nearer end (0
    inside): the error left once the measurement's own launch-to-launch spread is allowed."""
    return x / hi - 1 if x > hi else x / lo - 1 if x < lo else 0.0


def stats(errs: list) -> dict:
    e = np.abs(np.asarray(errs))
    return {"max_abs": float(e.max()), "median_abs": float(np.median(e)), "n": len(e),
            "goal_met": bool(e.max() <= 0.20 and np.median(e) <= 0.10)}
