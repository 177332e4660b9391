"""The recorded PD bench runs (``perf/bench/bench_pd.py`` -> ``perf/results/bench_pd*.json``) as
``perf/validate/validate_sim_pd.py`` reads them: with each launch's spans, which were made with
the idle decode pool sleeping, which on a machine running nothing else, the machine's conditions
per launch read off the bench50m probes beside it (``conditions``, ``host_terms``), and how far a
simulated figure lies from its launches."""
from __future__ import annotations

import gzip
import json
import os

import numpy as np

from .shapes import BENCH50M
from .sim_validation import host_terms as hop_host_terms

TOP_K, HIDDEN = BENCH50M.top_k, BENCH50M.hidden_size
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


def spans_path(result: str) -> str:
    """Where ``bench_pd.py --trace`` keeps a result's spans, gzipped: {"workload/layout":
    [each launch's spans]}."""
    return os.path.splitext(result)[0] + ".spans.json.gz"


def with_spans(path: str) -> dict:
    """A bench result with each launch's spans (``bench_pd.py --trace``'s .spans.json.gz)
    attached."""
    with open(path) as f:
        d = json.load(f)
    sp = spans_path(path)
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


def conditions(before: dict, after: dict, cores: int, mode: str = "load") -> dict:
    """A launch's machine from the probes before and after it, s_p and s_d their prefill and
    decode spans' mean slowdowns. A probe has one rank computing at a time, and
    ``NodeProfile.dilation`` gives one busy rank beside B other threads (1 + B) / cores, so
    B = cores * s - 1 (a probe faster than the reference, s < 1, scales the layer times by s
    instead). ``load`` (default): every rank sees B from s_p. ``split``: the PD prefill ranks,
    which compute for hundreds of ms without a pause, see B from s_p; the ping-pong ranks of the
    AE pipelines (the baseline, PD's decode pool), which wait between spans of a few ms and so
    lose less to other tenants, see B from s_d. ``scale``: every layer time scaled by s_p, no
    background load (perf/validate/validate_sim.py's speed factor)."""
    sp = (before["prefill"] + after["prefill"]) / 2
    sd = (before["decode"] + after["decode"]) / 2
    out = {"prefill_slowdown": sp, "decode_slowdown": sd}
    if mode == "scale":
        return dict(out, speed=sp, background_load=0.0, background_load_prefill=0.0)
    bp = max(0.0, cores * sp - 1.0)
    return dict(out, speed=min(1.0, sp), background_load_prefill=bp,
                background_load=max(0.0, cores * sd - 1.0) if mode == "split" else bp)


def host_terms(samples: list, hw) -> dict | None:
    """The node's wake-up latency and the host work per iteration read off bench50m calibration runs
    (``sim_validation.host_terms``, as the AE validation reads its own); None when no sample
    recorded its hops (runs before 2026-12-01 04:00)."""
    hops = [x for s in samples for x in s.get("hops", [])]
    steps = [x for s in samples for x in s.get("step_gaps", [])]
    return hop_host_terms(hops, steps, hw.inter_link, TOP_K * HIDDEN * 4) if hops and steps else None
