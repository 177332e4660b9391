"""The offline job: requests in, one jsonl line per finished request out, a summary at the end.

``run_offline_job`` works with any generator that has ``generate_stream(requests) ->
Iterator[RequestOutput]`` (single mode: ``megainfer.LLM``; the distributed runtime plugs in its
own). Each line is written and flushed the moment its request finishes, so a killed job leaves
every finished result on disk; a rerun with the same output skips the ids whose record finished
and runs again those whose record is an error, replacing it (``launch/resume.py``). Bad input lines (``inputs.BadLine``) are
written as error records first, without reaching the generator, and counted in ``errors``. An
output that cannot be created is an ``OutputFileError`` before the generator is asked for anything.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator, Optional, Protocol

import numpy as np
from tqdm.auto import tqdm

from megainfer.engine import CompletionOutput, PromptInput, RequestOutput

from .inputs import BadLine
from .resume import OutputRecords, plan_resume, read_output
from megainfer.config.offline_job import OutputFileError

log = logging.getLogger("megainfer.launch")


class Generator(Protocol):
    def generate_stream(self, requests: Iterable[PromptInput]) -> Iterator[RequestOutput]: ...


@dataclass
class JobSummary:
    requests: int  # finished this run (errors excluded)
    errors: int
    skipped: int  # already done in the output (resume)
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: Optional[float]
    ttft_p99_ms: Optional[float]
    tpot_p50_ms: Optional[float]
    tpot_p99_ms: Optional[float]
    output: str = ""
    cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    prefix_hit_rate: Optional[float] = None  # cached_prompt_tokens / prompt_tokens
    # prefill replicas (docs/pd.md): prefill end -> decode start over the requests handed off
    kv_handoff_p50_ms: Optional[float] = None
    kv_handoff_p99_ms: Optional[float] = None
    replans: list = field(default_factory=list)  # re-plans of the split (docs/replan.md)
    # the input's requests = new + retried + skipped (resume; launch/resume.py)
    new: int = 0  # no record in the output before this run
    retried: int = 0  # their record was an error: run again, the record replaced
    pipeline: Optional[dict] = None  # trace.enabled: figures read off the trace (trace_metrics)

    def table(self) -> str:
        def ms(v):
            return "-" if v is None else f"{v:.2f}"
        total = self.new + self.retried + self.skipped
        rows = [("requests", f"{total}: {self.new} new, {self.retried} retried, "
                             f"{self.skipped} skipped (already done)"),
                ("finished / errors", f"{self.requests} / {self.errors}"),
                ("prompt / output tokens", f"{self.prompt_tokens} / {self.output_tokens}"),
                ("prefix cache hit rate", "-" if self.prefix_hit_rate is None else
                 f"{100 * self.prefix_hit_rate:.1f}% ({self.cached_prompt_tokens} tokens)"),
                ("elapsed (s)", f"{self.elapsed_s:.2f}"),
                ("requests/s", f"{self.requests_per_s:.2f}"),
                ("output tokens/s", f"{self.output_tokens_per_s:.1f}"),
                ("TTFT p50 / p99 (ms)", f"{ms(self.ttft_p50_ms)} / {ms(self.ttft_p99_ms)}"),
                ("TPOT p50 / p99 (ms)", f"{ms(self.tpot_p50_ms)} / {ms(self.tpot_p99_ms)}"),
                ("output", self.output)]
        if self.kv_handoff_p50_ms is not None:
            rows.insert(-1, ("prefill end -> decode start p50 / p99 (ms)",
                             f"{ms(self.kv_handoff_p50_ms)} / {ms(self.kv_handoff_p99_ms)}"))
        for r in self.replans:
            rows.insert(-1, (f"re-plan at iteration {r['iteration']}",
                             f"{r['old']} -> {r['new']} ({r['reason']}), switch {r['seconds']:.3f} s"
                             + ("" if r.get("measured_gain") is None or r["measured_gain"] !=
                                r["measured_gain"] else
                                f", measured gain {100 * r['measured_gain']:.1f}%")))
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def _logprobs_json(positions) -> list:
    """[{token_id: Logprob}] -> [{"token_id": logprob}] (JSON object keys are strings)."""
    return [None if d is None else {str(t): lp.logprob for t, lp in d.items()} for d in positions]


def _completion_fields(c) -> dict:
    rec = {"token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason}
    if c.stop_reason is not None:
        rec["stop_reason"] = c.stop_reason
    if c.logprobs is not None:
        rec["logprobs"] = _logprobs_json(c.logprobs)
        rec["cumulative_logprob"] = c.cumulative_logprob
    return rec


def output_record(out: RequestOutput) -> dict:
    """One jsonl line. The first completion's fields at the top level; with ``n`` > 1 also
    ``"outputs"``: every completion (``index``, ``token_ids``, ``text``, ``finish_reason``, and
    the logprob fields when asked), and ``output_tokens`` counts all of them."""
    if out.error is not None:
        return {"id": out.request_id, "token_ids": [], "text": "", "finish_reason": "error",
                "error": out.error}
    c, m = out.outputs[0], out.metrics
    rec = {"id": out.request_id, **_completion_fields(c),
           "prompt_tokens": len(out.prompt_token_ids),
           "output_tokens": sum(len(o.token_ids) for o in out.outputs)}
    if out.num_cached_tokens is not None:
        rec["num_cached_tokens"] = out.num_cached_tokens
    if out.prompt_logprobs is not None:
        rec["prompt_logprobs"] = _logprobs_json(out.prompt_logprobs)
    if len(out.outputs) > 1:
        rec["outputs"] = [{"index": o.index, **_completion_fields(o)} for o in out.outputs]
    if m is not None:
        rec.update(ttft_s=m.ttft, tpot_s=m.tpot(len(c.token_ids)), latency_s=m.latency,
                   num_preemptions=m.num_preemptions)
        if m.kv_handoff_s is not None:
            rec["kv_handoff_s"] = m.kv_handoff_s
    return rec


def _pct(xs: list[float], q: float) -> Optional[float]:
    return float(np.percentile(xs, q) * 1e3) if xs else None


def run_offline_job(requests: list[PromptInput], generator: Generator, output_path: str,
                    resume: bool = True, progress: bool = True) -> JobSummary:
    """Stream every request through ``generator``, appending each result to ``output_path``.
    ``BadLine`` entries are written as error records without reaching the generator."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
        plan = plan_resume(requests, read_output(output_path) if resume
                           else OutputRecords(output_path))
        f = open(output_path, "a" if resume else "w", encoding="utf-8")
    except OSError as e:
        raise OutputFileError(f"io.output={output_path!r}: cannot write it "
                              f"({e.strerror or e})") from e
    todo, skipped = plan.todo, plan.skipped
    if skipped:
        log.info("[launch] resume: %d of %d requests already done in %s", skipped, len(requests),
                 output_path)
    bad = [r for r in todo if isinstance(r, BadLine)]
    todo = [r for r in todo if not isinstance(r, BadLine)]
    if bad:
        log.warning("[launch] %d bad input line(s) written as error records (io.strict=true "
                    "refuses the file instead); the first: %s", len(bad), bad[0].error)
    bar = _bar(len(todo) + len(bad), progress)
    n_ok = n_err = p_tok = o_tok = c_tok = 0
    ttft, tpot, handoff = [], [], []
    t0 = time.perf_counter()
    with f:
        for out in _chain((_bad_line_output(b) for b in bad), generator.generate_stream(todo)):
            rec = output_record(out)
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            if out.error is not None:
                n_err += 1
            else:
                n_ok += 1
                p_tok += rec["prompt_tokens"]
                o_tok += rec["output_tokens"]
                c_tok += rec.get("num_cached_tokens", 0)
                if rec.get("ttft_s") is not None:
                    ttft.append(rec["ttft_s"])
                if rec.get("tpot_s") is not None:
                    tpot.append(rec["tpot_s"])
                if rec.get("kv_handoff_s") is not None:
                    handoff.append(rec["kv_handoff_s"])
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"output {o_tok / max(time.perf_counter() - t0, 1e-9):.1f} "
                                    "tok/s", refresh=False)
    if bar is not None:
        bar.close()
    dt = max(time.perf_counter() - t0, 1e-9)
    return JobSummary(n_ok, n_err, skipped, p_tok, o_tok, dt, n_ok / dt, o_tok / dt,
                      _pct(ttft, 50), _pct(ttft, 99), _pct(tpot, 50), _pct(tpot, 99),
                      output=output_path, cached_prompt_tokens=c_tok,
                      prefix_hit_rate=c_tok / p_tok if p_tok else None,
                      kv_handoff_p50_ms=_pct(handoff, 50), kv_handoff_p99_ms=_pct(handoff, 99),
                      new=plan.new, retried=plan.retried)


def _bad_line_output(b: BadLine) -> RequestOutput:
    return RequestOutput(b.request_id, None, [], [CompletionOutput(0, "", [], "error")], True,
                         None, b.error)


def _chain(first: Iterator[RequestOutput],
           rest: Iterable[RequestOutput]) -> Iterator[RequestOutput]:
    """``first``, then ``rest`` (whose generator starts only once ``first`` is exhausted)."""
    yield from first
    yield from rest


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)


def write_summary(summary: JobSummary, path: str) -> None:
    with open(path, "w") as f:
        json.dump(asdict(summary), f, indent=2)
