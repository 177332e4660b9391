"""The job's requests: from an input file (jsonl / txt) or the configured workload.

jsonl: one JSON object a line, ``{"id": ..., "prompt": "text"}`` or ``{"id": ...,
"prompt_token_ids": [...]}``, optionally ``"sampling": {...}`` overriding the job's sampling
parameters for that line. Without "id" a line's id is its line number. txt: one prompt a line
(blank lines skipped), id = line number. A malformed line is an ``InputFileError`` naming the
file and line, raised before any work starts. Each request's sampling seed is derived from the
job seed and its id, so a resumed job samples exactly what an uninterrupted one would.
"""
from __future__ import annotations

import json
import random
import zlib
from dataclasses import replace
from typing import Any

from megainfer.config import ConfigError
from megainfer.engine import PromptInput, SamplingParams
from megainfer.engine.errors import SamplingParamsError
from megainfer.engine.sampler import mix_seed

from .settings import JobSettings

LINE_KEYS = {"id", "prompt", "prompt_token_ids", "sampling"}


class InputFileError(ConfigError):
    """A line of io.input is malformed; the message names the file and line."""


def request_seed(job_seed: int, request_id: Any) -> int:
    return mix_seed(job_seed, zlib.crc32(json.dumps(request_id).encode()))


def _params(base: SamplingParams, job_seed: int, rid, override: dict, where: str) -> SamplingParams:
    try:
        p = replace(base, **override) if override else base
    except TypeError as e:
        raise InputFileError(f"{where}: sampling: {e}") from e
    except SamplingParamsError as e:
        raise InputFileError(f"{where}: sampling.{e}") from e
    return p if p.seed is not None else replace(p, seed=request_seed(job_seed, rid))


def _jsonl_line(line: str, where: str, lineno: int) -> tuple[Any, dict]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputFileError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(obj, dict):
        raise InputFileError(f"{where}: must be a JSON object, got {type(obj).__name__}")
    extra = sorted(set(obj) - LINE_KEYS)
    if extra:
        raise InputFileError(f"{where}: unknown key {extra[0]!r} (allowed: "
                             f"{', '.join(sorted(LINE_KEYS))})")
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        raise InputFileError(f"{where}: give exactly one of 'prompt' or 'prompt_token_ids'")
    if has_text and not isinstance(obj["prompt"], str):
        raise InputFileError(f"{where}: 'prompt' must be a string")
    if has_ids and not isinstance(obj["prompt_token_ids"], list):
        raise InputFileError(f"{where}: 'prompt_token_ids' must be a list of integers")
    if not isinstance(obj.get("sampling", {}), dict):
        raise InputFileError(f"{where}: 'sampling' must be an object")
    rid = obj.get("id", lineno)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise InputFileError(f"{where}: 'id' must be a string or an integer, got {rid!r}")
    return rid, obj


def read_requests(path: str, base: SamplingParams, job_seed: int) -> list[PromptInput]:
    """Parse the whole file first: a malformed line fails the job before any work starts."""
    out, seen = [], {}
    txt = path.endswith(".txt")
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise InputFileError(f"io.input={path!r}: cannot open ({e.strerror})") from e
    with f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            if txt:
                rid, obj = lineno, {"prompt": line}
            else:
                rid, obj = _jsonl_line(line, where, lineno)
            key = json.dumps(rid)
            if key in seen:
                raise InputFileError(f"{where}: duplicate id {rid!r} (first on line {seen[key]})")
            seen[key] = lineno
            params = _params(base, job_seed, rid, obj.get("sampling"), where)
            out.append(PromptInput(rid, obj.get("prompt"), obj.get("prompt_token_ids"), params))
    return out


def workload_requests(s: JobSettings) -> list[PromptInput]:
    w = s.workload
    if w.kind == "prompts":
        return [PromptInput(i, p, None, _params(s.sampling, s.seed, i, {}, ""))
                for i, p in enumerate(w.prompts)]
    g = random.Random(w.seed)
    return [PromptInput(i, None, [g.randrange(s.model.vocab_size) for _ in range(w.input_len)],
                        _params(s.sampling, s.seed, i, {}, "")) for i in range(w.num_prompts)]


def job_requests(s: JobSettings) -> list[PromptInput]:
    if s.io.input:
        return read_requests(s.io.input, s.sampling, s.seed)
    return workload_requests(s)
