"""The offline job's own groups (``io``, ``workload``): frozen, validated, each error naming the
key; an output file that cannot be written refused before any work starts."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .base import ConfigError


class OutputFileError(ConfigError):
    """io.output cannot be created or written; raised before any work starts."""


def check_output_path(path: str) -> None:
    """Refuse an output that cannot be written, without creating anything: a directory, an
    existing file without write permission, a parent that is a file, or a missing directory
    whose nearest existing ancestor does not allow creating it."""
    key = f"io.output={path!r}"
    p = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(p):
        raise OutputFileError(f"{key}: is a directory (give a file path, e.g. {path.rstrip('/')}"
                              "/generations.jsonl)")
    if os.path.exists(p):
        if not os.access(p, os.W_OK):
            raise OutputFileError(f"{key}: no permission to write it")
        return
    d = os.path.dirname(p)
    while not os.path.exists(d):
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise OutputFileError(f"{key}: cannot create it: {d} is a file, not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise OutputFileError(f"{key}: cannot create it: no permission to write in {d}")


@dataclass(frozen=True)
class IOSettings:
    input: Optional[str] = None
    output: Optional[str] = None
    resume: bool = True
    progress: bool = True
    strict: bool = False  # a bad input line refuses the whole file (else: an error record)

    def __post_init__(self):
        for k in ("resume", "progress", "strict"):
            if not isinstance(getattr(self, k), bool):
                raise ConfigError(f"io.{k}={getattr(self, k)!r}: must be true or false")
        for k in ("input", "output"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ConfigError(f"io.{k}={v!r}: must be a file path or null")


@dataclass(frozen=True)
class WorkloadSettings:
    kind: str = "prompts"  # prompts | random
    prompts: tuple[str, ...] = ()
    num_prompts: int = 0
    input_len: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.kind not in ("prompts", "random"):
            raise ConfigError(f"workload.kind={self.kind!r}: must be 'prompts' or 'random'")
        if self.kind == "random" and (self.num_prompts < 1 or self.input_len < 1):
            raise ConfigError(f"workload.num_prompts={self.num_prompts}, workload.input_len="
                              f"{self.input_len}: a random workload needs both >= 1")
