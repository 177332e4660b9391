"""Traces for ``megainfer-bench-serve --trace``: requests sent at recorded times with recorded
prompt and output lengths (open loop: nothing waits for an answer), read from a trace file
(Azure LLM inference CSV, BurstGPT CSV, or this project's jsonl) or made from named phases
(``--trace-shape prompt_heavy_burst:60,decode_heavy_steady:60``); results per phase, and the
timeline picture (rate, latency, re-plan switches over the run). docs/serve.md, "Trace replay"."""
from __future__ import annotations

import asyncio
import csv
import datetime
import json
import random
import time
from dataclasses import dataclass
from typing import Optional

import httpx

# CSV header -> (timestamp column, prompt tokens column, output tokens column)
CSV_FORMATS = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),  # Azure LLM inference traces
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),  # BurstGPT
    "plain": ("timestamp", "input_len", "output_len"),
}


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: ``at`` seconds after the trace's first request."""

    at: float
    input_len: int
    output_len: int
    phase: str = ""


@dataclass(frozen=True)
class Phase:
    """A synthetic phase, relative to the base rate and lengths (``--request-rate``,
    ``--random-input-len``, ``--random-output-len``); ``burstiness``: the gamma shape of the
    gaps (1: Poisson; below 1: bursts)."""

    rate: float
    input_len: float
    output_len: float
    burstiness: float = 1.0


PHASES = {
    "steady": Phase(1.0, 1.0, 1.0),
    "prompt_heavy_burst": Phase(2.0, 4.0, 0.25, burstiness=0.3),
    "decode_heavy_steady": Phase(1.0, 0.25, 4.0),
    "long_context_spike": Phase(0.5, 8.0, 1.0, burstiness=0.5),
}
LENGTH_SPREAD = 0.25  # synthetic lengths: uniform within +-25% of the phase's


def _seconds(value: str, where: str) -> float:
    """A timestamp: seconds as a number, or an ISO date and time (Azure's
    ``2023-11-16 18:15:46.6805900``: 3.11's parser takes 7 fractional digits)."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.datetime.fromisoformat(value.strip()).timestamp()
    except ValueError:
        raise ValueError(f"{where}: timestamp {value!r} is neither seconds nor an ISO date and "
                         "time") from None


def _count(value, where: str, field: str) -> int:
    try:
        n = int(float(value))
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {field}={value!r} is not a token count") from None
    if n < 0:
        raise ValueError(f"{where}: {field}={value!r} is negative")
    return n


def read_trace(path: str) -> list[TraceRow]:
    """A trace file -> its requests by time, ``at`` from the first one. ``.jsonl``: one
    ``{"timestamp", "input_len", "output_len", "phase"?}`` a line; otherwise CSV with one of
    ``CSV_FORMATS``' headers. Requests with no prompt or no output tokens (failed ones, in
    BurstGPT) are left out. A bad row raises ``ValueError`` naming the file, line and field."""
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        if path.endswith(".jsonl"):
            for k, line in enumerate(f, 1):
                if line.strip():
                    rows.append(_json_row(line, f"{path}:{k}"))
        else:
            reader = csv.DictReader(f)
            cols = next((c for c in CSV_FORMATS.values()
                         if set(c) <= set(reader.fieldnames or ())), None)
            if cols is None:
                raise ValueError(f"{path}: a CSV header with one of {list(CSV_FORMATS.values())}"
                                 f" is needed, got {reader.fieldnames}")
            for k, d in enumerate(reader, 2):
                where = f"{path}:{k}"
                rows.append(TraceRow(_seconds(d[cols[0]], where), _count(d[cols[1]], where,
                                     cols[1]), _count(d[cols[2]], where, cols[2]),
                                     d.get("phase") or ""))
    rows = sorted((r for r in rows if r.input_len > 0 and r.output_len > 0), key=lambda r: r.at)
    if not rows:
        raise ValueError(f"{path}: no requests")
    t0 = rows[0].at
    return [TraceRow(r.at - t0, r.input_len, r.output_len, r.phase) for r in rows]


def _json_row(line: str, where: str) -> TraceRow:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(d, dict) or not {"timestamp", "input_len", "output_len"} <= d.keys():
        raise ValueError(f"{where}: needs timestamp, input_len and output_len")
    return TraceRow(_seconds(str(d["timestamp"]), where), _count(d["input_len"], where,
                    "input_len"), _count(d["output_len"], where, "output_len"),
                    str(d.get("phase") or ""))


def parse_shape(spec: str) -> list[tuple[str, float]]:
    """``name:seconds,name:seconds`` -> [(phase, seconds)], names from ``PHASES``."""
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, _, secs = part.partition(":")
        if name not in PHASES:
            raise ValueError(f"--trace-shape {part!r}: phase {name!r} is not one of "
                             f"{sorted(PHASES)}")
        try:
            s = float(secs)
        except ValueError:
            raise ValueError(f"--trace-shape {part!r}: give the phase's seconds, "
                             f"e.g. {name}:60") from None
        if s <= 0:
            raise ValueError(f"--trace-shape {part!r}: seconds must be > 0")
        out.append((name, s))
    if not out:
        raise ValueError("--trace-shape: no phases")
    return out


def make_trace(shape: list[tuple[str, float]], rate: float, input_len: int, output_len: int,
               seed: int = 0, max_len: Optional[int] = None) -> list[TraceRow]:
    """Phases back to back: each sends at ``rate x Phase.rate`` requests/s (gamma gaps of its
    burstiness) for its seconds (the first request at 0), lengths uniform within ``LENGTH_SPREAD`` of the base lengths
    times its factors, a prompt plus output within ``max_len`` when given."""
    rng, rows, start = random.Random(seed), [], 0.0
    for name, secs in shape:
        ph = PHASES[name]
        r, b = rate * ph.rate, ph.burstiness
        gap = rng.gammavariate(b, 1.0 / (r * b))
        t = start + (gap if rows or start else 0.0)  # the trace's first request at 0
        while t < start + secs:
            n_in = _draw(rng, input_len * ph.input_len)
            n_out = _draw(rng, output_len * ph.output_len)
            if max_len is not None:
                n_in = min(n_in, max_len - 1)
                n_out = max(1, min(n_out, max_len - n_in))
            rows.append(TraceRow(round(t, 6), n_in, n_out, name))
            t += rng.gammavariate(b, 1.0 / (r * b))
        start += secs
    return rows


def _draw(rng: random.Random, n: float) -> int:
    lo, hi = max(1, int(n * (1 - LENGTH_SPREAD))), max(1, int(n * (1 + LENGTH_SPREAD)))
    return rng.randint(lo, hi)


def write_trace(rows: list[TraceRow], path: str) -> None:
    """The jsonl that ``read_trace`` reads back."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"timestamp": r.at, "input_len": r.input_len,
                                "output_len": r.output_len, "phase": r.phase}) + "\n")


def phase_windows(rows: list[TraceRow]) -> list[dict]:
    """The trace's phases in order of first request: name, first and last ``at``, requests."""
    out: dict[str, dict] = {}
    for r in rows:
        w = out.setdefault(r.phase, {"phase": r.phase, "start": r.at, "end": r.at, "n": 0})
        w["end"], w["n"] = r.at, w["n"] + 1
    return list(out.values())


def trace_rows(a) -> Optional[list[TraceRow]]:
    """The rows of ``megainfer-bench-serve``'s trace (``a``: its arguments, ``--trace`` or
    ``--trace-shape``), or None."""
    if a.trace:
        return read_trace(a.trace)
    if a.trace_shape:
        rows = make_trace(parse_shape(a.trace_shape), a.request_rate,
                                      a.random_input_len, a.random_output_len, a.seed,
                                      a.trace_max_len)
        if a.trace_save:
            write_trace(rows, a.trace_save)
        return rows
    return None


def phase_table(phases: dict, p: float) -> str:
    """``summarize_phases``' results as a table (percentile ``p`` of TTFT and TPOT)."""
    head = (f"{'phase':<22}{'reqs':>6}{'secs':>8}{'req/s':>8}{'good/s':>8}"
            f"{f'p{p:g} TTFT':>11}{f'p{p:g} TPOT':>11}")
    rows = [head, "-" * len(head)]
    for name, d in phases.items():
        good = d["request_goodput"]
        rows.append(f"{name or '-':<22}{d['completed']:>6}{d['duration']:>8.1f}"
                    f"{d['request_throughput']:>8.2f}{'-' if good is None else f'{good:.2f}':>8}"
                    f"{d[f'p{p:g}_ttft_ms']:>11.1f}{d[f'p{p:g}_tpot_ms']:>11.1f}")
    return "\n".join(rows)



async def replan_times(client: httpx.AsyncClient, base: str, t0: float, done: asyncio.Event,
                       times: list, every_s: float = 1.0) -> None:
    """Append to ``times`` the seconds (from ``t0``) at which the server's
    ``megainfer:replans`` counter was seen to rise (its ``/metrics`` polled every ``every_s``)."""
    last = None
    while not done.is_set():
        try:
            text = (await client.get(base + "/metrics")).text
            n = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("megainfer:replans_total"))
        except (httpx.HTTPError, ValueError, IndexError):
            n = last
        if last is not None and n is not None and n > last:
            times.append(time.perf_counter() - t0)
        last = n
        try:
            await asyncio.wait_for(done.wait(), every_s)
        except asyncio.TimeoutError:
            pass


def timeline(path: str, rows: list[TraceRow], results: list, switches: list[float],
             slos: dict, window_s: Optional[float] = None) -> None:
    """A PNG: arrivals per second and output tokens per second by window, each request's TTFT
    and TPOT at its send time (the SLOs dashed), the phases shaded and the re-plan switches
    marked; ``window_s`` (default: a fortieth of the run, at least 1 s). Needs matplotlib (the
    ``plot`` extra)."""
    import matplotlib  # optional dependency (the plot extra)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    end = max([r.at for r in rows] + [x.sent_at + x.latency for x in results]) + 1e-9
    window_s = window_s or max(1.0, end / 40)
    edges = [i * window_s for i in range(int(end // window_s) + 2)]
    fig, ax = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    arrivals = [sum(e <= r.at < e + window_s for r in rows) / window_s for e in edges]
    tokens = [sum(x.output_tokens for x in results if x.success and
                  e <= x.sent_at + x.latency < e + window_s) / window_s for e in edges]
    ax[0].step(edges, arrivals, where="post", label="arrivals / s")
    ax[0].set_ylabel("requests / s")
    ax0b = ax[0].twinx()
    ax0b.step(edges, tokens, where="post", color="tab:green", label="output tokens / s")
    ax0b.set_ylabel("output tokens / s")
    ax[0].legend(handles=ax[0].lines + ax0b.lines, loc="upper right", fontsize=8)
    ok = [x for x in results if x.success]
    for i, (m, val) in enumerate((("ttft", lambda x: x.ttft), ("tpot", lambda x: (
            x.latency - x.ttft) / max(1, x.output_tokens - 1)))):
        a = ax[i + 1]
        a.scatter([x.sent_at for x in ok], [val(x) * 1000 for x in ok], s=6)
        if m in slos:
            a.axhline(slos[m], ls="--", color="tab:red", label=f"SLO {slos[m]:g} ms")
            a.legend(loc="upper right")
        a.set_ylabel(f"{m.upper()} (ms)")
    for i, w in enumerate(phase_windows(rows)):
        for a in ax:
            a.axvspan(w["start"], w["end"], alpha=0.08, color=f"C{i % 8}")
        ax[0].text(w["start"], 0, w["phase"], fontsize=7, va="bottom")
    for s in switches:
        for a in ax:
            a.axvline(s, color="black", lw=0.8)
    ax[-1].set_xlabel("seconds since the trace's first request (vertical lines: re-plans)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["TraceRow", "Phase", "PHASES", "read_trace", "parse_shape", "make_trace",
           "write_trace", "phase_windows", "trace_rows", "phase_table", "replan_times",
           "timeline"]
