"""What a rerun of the offline job does with the output already on disk (``io.resume``).

The output holds one current record per id. A rerun sorts the job's requests against it:
``skipped`` (the record finished, or it is the error record of an input line still bad with
the very same error), ``retried`` (the record is an error: it runs again, its old error record
dropped from the file before the new one is appended) or ``new`` (no record yet). Invariant:
the output stays one line per id. A torn last line (a killed job) is cut off first; error
records of ids the input no longer has are kept as they are. docs/engine.md, "The offline job
(`megainfer-launch`)"."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from megainfer.engine import PromptInput

from .inputs import BadLine

log = logging.getLogger("megainfer.launch")


@dataclass
class OutputRecords:
    """The complete lines of an existing output: each id (json-encoded) -> its error text, or
    None when its record finished."""

    path: str
    status: dict = field(default_factory=dict)  # json id -> error str | None
    lines: list = field(default_factory=list)  # (json id, raw line bytes) in file order


def read_output(path: str) -> OutputRecords:
    """The records of ``path`` (none when it does not exist); a torn tail is truncated away."""
    out = OutputRecords(path)
    if not os.path.exists(path):
        return out
    with open(path, "rb") as f:
        data = f.read()
    good = 0
    for raw in data.splitlines(keepends=True):
        try:
            if not raw.endswith(b"\n"):
                raise ValueError("torn line")
            rec = json.loads(raw)
            key = json.dumps(rec["id"])
        except (ValueError, KeyError, TypeError):
            break
        out.status[key] = str(rec.get("error", "")) if rec.get("finish_reason") == "error" else None
        out.lines.append((key, raw))
        good += len(raw)
    if good < len(data):
        log.warning("[launch] %s: dropping %d bytes after the last complete line", path,
                    len(data) - good)
        with open(path, "r+b") as f:
            f.truncate(good)
    return out


def done_ids(path: str) -> set[str]:
    """Ids (json-encoded) with a record in ``path``, finished or error."""
    return set(read_output(path).status)


@dataclass
class ResumePlan:
    todo: list  # the requests to run (new and retried), in input order
    new: int
    retried: int
    skipped: int


def plan_resume(requests: list[PromptInput], records: OutputRecords) -> ResumePlan:
    """Sort ``requests`` against ``records`` (module docstring) and drop the error records of
    the retried ids from the file."""
    todo, retry, skipped = [], set(), 0
    for r in requests:
        key = json.dumps(r.request_id)
        if key not in records.status:
            todo.append(r)
        elif records.status[key] is None or (isinstance(r, BadLine)
                                             and r.error == records.status[key]):
            skipped += 1
        else:
            todo.append(r)
            retry.add(key)
    if retry:
        _drop_lines(records, retry)
        log.info("[launch] resume: %d request(s) whose record is an error run again",
                 len(retry))
    return ResumePlan(todo, len(todo) - len(retry), len(retry), skipped)


def _drop_lines(records: OutputRecords, keys: set[str]) -> None:
    """Rewrite the output without the lines of ``keys`` (a temporary file, then an atomic
    rename: a job killed meanwhile leaves the old file whole)."""
    tmp = records.path + ".resume.tmp"
    with open(tmp, "wb") as f:
        f.writelines(raw for key, raw in records.lines if key not in keys)
    os.replace(tmp, records.path)
    records.lines = [(k, raw) for k, raw in records.lines if k not in keys]
    for k in keys:
        del records.status[k]
