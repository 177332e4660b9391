"""A config group's preset (``conf/<group>/<name>.yaml``, the launcher's ``group=name``) -> its
plain dict, read without Hydra (for ``LLM(deploy="a1e2")``); and ``group.key=value`` override
strings -> a nested dict, values read as YAML scalars as Hydra reads them."""
from __future__ import annotations

from importlib import resources

from .base import ConfigError
from .keys import closest


def preset_names(group: str) -> list[str]:
    d = resources.files("megainfer.conf") / group
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".yaml"))


def load_preset(group: str, name: str, key: str) -> dict:
    """``conf/<group>/<name>.yaml`` as a dict; an unknown name is a ConfigError on ``key``
    listing the presets (and the closest one)."""
    import yaml
    names = preset_names(group)
    if name not in names:
        near = closest(str(name), names)
        raise ConfigError(f"{key}={name!r}: no such {group} preset (" + (
            f"did you mean {near!r}?; " if near else "") + f"known: {', '.join(names)})")
    text = (resources.files("megainfer.conf") / group / f"{name}.yaml").read_text()
    return dict(yaml.safe_load(text) or {})


def parse_override(item: str, key: str) -> tuple[list[str], object]:
    """``"comm.timeout_s=20"`` -> (["comm", "timeout_s"], 20.0-as-YAML-reads-it)."""
    import yaml
    if not isinstance(item, str) or "=" not in item or item[:1] in "+~":
        raise ConfigError(f"{key}={item!r}: give group.key=value (e.g. comm.timeout_s=20)")
    name, _, text = item.partition("=")
    path = name.strip().split(".")
    if len(path) < 2 or not all(path):
        raise ConfigError(f"{key}={item!r}: give group.key=value (e.g. comm.timeout_s=20)")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}={item!r}: the value is not a YAML scalar ({e})") from None
    return path, value
