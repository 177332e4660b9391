"""One group of the composed config -> a plain dict whose keys are all known (``ConfigError``
naming the first unknown key otherwise). Shared by the settings (launch/settings.py) and the
planner at launch (launch/auto_plan.py), so both refuse the same keys the same way."""
from __future__ import annotations

from dataclasses import fields
from typing import Mapping

from megainfer.config import ConfigError


def take(group: str, d: Mapping, known: set) -> dict:
    """``group``'s keys checked against ``known`` (e.g. ``field_names(SchedulerConfig)``)."""
    d = dict(d or {})
    for k in d:
        if k not in known:
            raise ConfigError(f"{group}.{k}={d[k]!r}: unknown config key (known: "
                              f"{', '.join(sorted(known))})")
    return d


def field_names(cls) -> set:
    """The field names of a config dataclass: the keys its group accepts."""
    return {f.name for f in fields(cls)}
