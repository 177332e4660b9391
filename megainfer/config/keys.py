"""One group of a config tree -> a plain dict whose keys are all known (``ConfigError`` naming
the first unknown key and the closest known one otherwise). Shared by the resolution
(``resolve.py``), the launcher's own groups and the planner at launch, so all refuse the same
keys the same way."""
from __future__ import annotations

import difflib
from dataclasses import fields
from typing import Iterable, Mapping, Optional

from .base import ConfigError


def closest(name: str, known: Iterable[str]) -> Optional[str]:
    """The known name nearest to a mistyped one (``micro_batchs`` -> ``micro_batches``), or None."""
    hits = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return hits[0] if hits else None


def unknown_key_error(group: str, key: str, value, known: Iterable[str]) -> ConfigError:
    """``group.key=value: unknown config key (did you mean group.other?; known: ...)``."""
    known = sorted(known)
    near = closest(key, known)
    hint = f"did you mean {group}.{near}?; " if near else ""
    return ConfigError(f"{group}.{key}={value!r}: unknown config key ({hint}known: "
                       f"{', '.join(known)})")


def take(group: str, d: Mapping, known: set) -> dict:
    """``group``'s keys checked against ``known`` (e.g. ``field_names(SchedulerConfig)``)."""
    d = dict(d or {})
    for k in d:
        if k not in known:
            raise unknown_key_error(group, k, d[k], known)
    return d


def field_names(cls) -> set:
    """The field names of a config dataclass: the keys its group accepts."""
    return {f.name for f in fields(cls)}
