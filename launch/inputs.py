"""The job's requests: from an input file (jsonl / txt) or the configured workload.

jsonl: one JSON object a line, ``{"id", "prompt"}``, ``{"id", "prompt_token_ids"}`` or
``{"id", "messages"}`` (rendered with the checkpoint's chat template), optionally with
``"sampling": {...}`` overriding the job's sampling for that line; without "id" the id is the
line number. txt: one prompt a line (blank lines skipped). A bad line becomes a ``BadLine``:
the job writes an error record for it (``"finish_reason": "error"``, ``"error":
"<file>:<line>: <reason>"``) and runs the rest; with ``strict`` the whole file is refused
first (one ``InputFileError`` listing every bad line). Invariant: each request's seed comes
from the job seed and its id, so a resumed job samples what an uninterrupted one would.
docs/engine.md, "The offline job (`megainfer-launch`)"; "Bad input"."""
from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from megainfer.config import ConfigError
from megainfer.engine import PromptInput, SamplingParams
from megainfer.engine.chat_template import ChatRenderer, ChatTemplateError, encode_chat
from megainfer.engine.errors import RequestError, SamplingParamsError
from megainfer.engine.sampler import mix_seed
from megainfer.engine.tokenizer import load_tokenizer

from megainfer.engine.job_doors import JobSettings

LINE_KEYS = {"id", "prompt", "prompt_token_ids", "messages", "sampling"}
PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
STRICT_LIST_MAX = 50  # bad lines named in full in a strict refusal; the rest are counted


class InputFileError(ConfigError):
    """io.input is unreadable, or (strict) has bad lines; the message names the file and lines."""


class _LineError(Exception):
    """One bad line: the reason, and whether the line's id can stand for it in the output."""

    def __init__(self, reason: str, keep_id: bool = True):
        super().__init__(reason)
        self.keep_id = keep_id


@dataclass
class BadLine(PromptInput):
    """An input line that could not become a request: the job writes ``error`` as its record."""

    error: str = ""
    line: int = 0


# messages -> prompt token ids; raises ValueError (ChatTemplateError) naming what is wrong
ChatEncoder = Callable[[list], list]


def request_seed(job_seed: int, request_id: Any) -> int:
    return mix_seed(job_seed, zlib.crc32(json.dumps(request_id).encode()))


def _params(base: SamplingParams, job_seed: int, rid, override: Optional[dict]) -> SamplingParams:
    try:
        p = replace(base, **override) if override else base
    except TypeError as e:
        raise _LineError(f"sampling: {e}") from e
    except SamplingParamsError as e:
        raise _LineError(f"sampling.{e}") from e
    return p if p.seed is not None else replace(p, seed=request_seed(job_seed, rid))


def _parse(line: str, lineno: int) -> tuple[Any, dict]:
    """(id, object) of a jsonl line, or ``_LineError``."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _LineError(f"not valid JSON ({e.msg} at column {e.colno})", keep_id=False) from e
    if not isinstance(obj, dict):
        raise _LineError(f"must be a JSON object, got {type(obj).__name__}", keep_id=False)
    rid = obj.get("id", lineno)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise _LineError(f"'id' must be a string or an integer, got {rid!r}", keep_id=False)
    return rid, obj


def _check(obj: dict) -> None:
    extra = sorted(set(obj) - LINE_KEYS)
    if extra:
        raise _LineError(f"unknown key {extra[0]!r} (allowed: {', '.join(sorted(LINE_KEYS))})")
    given = [k for k in PROMPT_KEYS if k in obj]
    if len(given) != 1:
        raise _LineError("give exactly one of 'prompt', 'prompt_token_ids' or 'messages'"
                         + (f" (got {', '.join(given)})" if given else ""))
    if "prompt" in obj and not isinstance(obj["prompt"], str):
        raise _LineError("'prompt' must be a string")
    if "prompt_token_ids" in obj and not isinstance(obj["prompt_token_ids"], list):
        raise _LineError("'prompt_token_ids' must be a list of integers")
    if "messages" in obj and (not isinstance(obj["messages"], list) or not obj["messages"]):
        raise _LineError("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    if not isinstance(obj.get("sampling", {}), dict):
        raise _LineError("'sampling' must be an object")


def _lines(path: str):
    """(line number, text) of each line; a line that is not UTF-8 comes as a ``_LineError``."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputFileError(f"io.input={path!r}: cannot open ({e.strerror})") from e
    with f:
        for lineno, raw in enumerate(f, 1):
            raw = raw.rstrip(b"\n").rstrip(b"\r")
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, _LineError(f"not UTF-8 text (byte {e.start + 1})", keep_id=False)


def read_requests(path: str, base: SamplingParams, job_seed: int, strict: bool = False,
                  chat: Optional[ChatEncoder] = None) -> list[PromptInput]:
    """Parse the whole file before any work: requests in file order, each bad line a
    ``BadLine`` (``strict``: one ``InputFileError`` listing them all instead). ``chat`` turns a
    "messages" line into token ids; without it such a line is bad (no chat template)."""
    out, bad, seen = [], [], {}
    txt = path.endswith(".txt")
    for lineno, line in _lines(path):
        if isinstance(line, str) and not line.strip():
            continue
        where, rid = f"{path}:{lineno}", lineno
        try:
            if isinstance(line, _LineError):
                raise line
            obj = {"prompt": line} if txt else None
            if obj is None:
                rid, obj = _parse(line, lineno)
            key = json.dumps(rid)
            if key in seen:
                raise _LineError(f"duplicate id {rid!r} (first on line {seen[key]})", keep_id=False)
            seen[key] = lineno
            _check(obj)
            params = _params(base, job_seed, rid, obj.get("sampling"))
            ids = obj.get("prompt_token_ids")
            if "messages" in obj:
                if chat is None:
                    raise _LineError("messages: no chat template to render them with")
                try:
                    ids = chat(obj["messages"])
                except (RequestError, ValueError) as e:
                    raise _LineError(f"messages: {e}") from e
            out.append(PromptInput(rid, obj.get("prompt"), ids, params))
        except _LineError as e:
            rec_id = rid if e.keep_id else lineno
            msg = f"{where}: {e}"
            bad.append(msg)
            out.append(BadLine(rec_id, error=msg, line=lineno))
    if strict and bad:
        more = len(bad) - STRICT_LIST_MAX
        raise InputFileError(f"io.input={path!r}: {len(bad)} bad line(s), nothing run "
                             "(io.strict=true):\n  " + "\n  ".join(bad[:STRICT_LIST_MAX])
                             + (f"\n  ... and {more} more" if more > 0 else ""))
    return out


def bad_lines(requests: list[PromptInput]) -> list[BadLine]:
    return [r for r in requests if isinstance(r, BadLine)]


def chat_encoder(s: JobSettings) -> ChatEncoder:
    """The checkpoint's template + tokenizer as a ``ChatEncoder``. A checkpoint without a
    template (or an unreadable one) gives an encoder that refuses every conversation, so each
    "messages" line becomes an error record naming why."""
    try:
        renderer = ChatRenderer(s.load.path)
        if renderer.template is None:
            raise ChatTemplateError(
                f"the checkpoint (model.path={s.load.path!r}) has no chat template (no "
                "chat_template.jinja, no chat_template in tokenizer_config.json)")
    except ChatTemplateError as e:
        err = e

        def refuse(messages):
            raise err
        return refuse
    tok = load_tokenizer(s.load.path, s.model.eos_token_id)
    return lambda messages: encode_chat(tok, renderer.render(messages, True))


def workload_requests(s: JobSettings) -> list[PromptInput]:
    w = s.workload
    if w.kind == "prompts":
        return [PromptInput(i, p, None, _params(s.sampling, s.seed, i, {}))
                for i, p in enumerate(w.prompts)]
    g = random.Random(w.seed)
    return [PromptInput(i, None, [g.randrange(s.model.vocab_size) for _ in range(w.input_len)],
                        _params(s.sampling, s.seed, i, {})) for i in range(w.num_prompts)]


def job_requests(s: JobSettings) -> list[PromptInput]:
    if s.io.input:
        return read_requests(s.io.input, s.sampling, s.seed, strict=s.io.strict,
                             chat=chat_encoder(s))
    return workload_requests(s)
