"""The launcher's command line before Hydra composes it: every ``group.key=value`` override
checked against the keys the job reads (a mistyped key gets megainfer's own message with the
closest known key, rather than Hydra's struct error, whose ``+key`` advice would only add a key
nobody reads), and ``--cfg job`` with ``model.path=`` printed with the architecture read from
the checkpoint, not the model preset's shapes (which ``model.path`` replaces)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from megainfer.config import ConfigError, ModelConfig
from megainfer.config.keys import closest, field_names, unknown_key_error
from megainfer.config.model_source import model_config_of

from megainfer.engine.job_doors import known_keys

_FREE_PREFIXES = ("+", "~", "hydra.", "hydra/")  # added / deleted keys; Hydra's own settings


def _overrides(args: Sequence[str]) -> list[str]:
    return [a for a in args if not a.startswith("-") and "=" in a
            and not a.startswith(_FREE_PREFIXES)]


def override_key_error(args: Sequence[str]) -> Optional[ConfigError]:
    """The first override whose key no group reads, as a ConfigError naming the closest key."""
    known = known_keys()
    for a in _overrides(args):
        name, _, text = a.partition("=")
        path = name.split(".")
        if path[0] not in known:  # deploy=a1e2 selects a preset: Hydra lists a group's options
            near = closest(path[0], known)
            return ConfigError(f"{a}: no such config group (" + (
                f"did you mean {near}?; " if near else "") + f"groups: {', '.join(sorted(known))})")
        if len(path) == 1:
            continue
        group, key = path[0], ".".join(path[1:])
        if group == "model" and path[1] == "arch" and len(path) > 2:
            group, key, keys = "model.arch", ".".join(path[2:]), field_names(ModelConfig)
        else:
            keys = known[group]
        if key not in keys:
            return unknown_key_error(group, key, _value(text), keys)
    return None


def _value(text: str):
    """The value as the message shows it (YAML's reading; Hydra's own grammar as it stands)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def wants_job_config(args: Sequence[str]) -> bool:
    """``--cfg job`` (or ``-c job``) with a ``model.path=`` override."""
    cfg = any(a in ("--cfg=job", "-c=job") or (a in ("--cfg", "-c") and nxt == "job")
              for a, nxt in zip(args, list(args[1:]) + [""]))
    return cfg and any(a.startswith("model.path=") and a.split("=", 1)[1] not in ("", "null")
                       for a in args)


def job_config_text(args: Sequence[str]) -> str:
    """The composed job config as ``--cfg job`` prints it, ``model.arch`` read from
    ``model.path`` (or a note saying it will be, when the checkpoint cannot be read now)."""
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("config", overrides=[a for a in args if not a.startswith("-")
                                           and a != "job" and not a.startswith("hydra")])
    c = OmegaConf.to_container(cfg, resolve=False)
    m = c.get("model") or {}
    try:
        arch = dataclasses.asdict(model_config_of({"path": m["path"],
                                                   "revision": m.get("revision")}))
        note = f"# model.arch: read from {m['path']} (its config.json)"
    except ConfigError as e:
        arch = None
        note = (f"# model.arch: read from model.path's config.json at run time (not now: {e}); "
                "the preset's shapes do not apply")
    m["arch"] = arch
    return note + "\n" + OmegaConf.to_yaml(OmegaConf.create(c))
