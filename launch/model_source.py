"""``model.path`` or ``model.arch`` -> ``ModelConfig``: a checkpoint directory's config.json, or a
preset's architecture written out key by key (conf/model/*.yaml). The job's settings and the
planner at launch both read the model through here."""
from __future__ import annotations

import os
from dataclasses import MISSING, fields
from typing import Any, Mapping

from megainfer.config import ConfigError, ModelConfig

from .config_keys import field_names, take


def model_config_from_arch(arch: Mapping[str, Any]) -> ModelConfig:
    """``model.arch`` (ModelConfig field names) -> ModelConfig; lists become tuples."""
    d = take("model.arch", arch, field_names(ModelConfig))
    for k in ("mlp_only_layers", "eos_token_id"):
        if k in d:
            v = d[k]
            d[k] = tuple(v) if isinstance(v, (list, tuple)) else (() if v is None else (v,))
    missing = [f.name for f in fields(ModelConfig) if f.name not in d and f.default is MISSING]
    if missing:
        raise ConfigError(f"model.arch: missing {', '.join(missing)}")
    return ModelConfig(**d)


def model_config_of(m: Mapping[str, Any]) -> ModelConfig:
    """The ``model`` group -> its ModelConfig (``path`` wins over ``arch``)."""
    if m.get("path"):
        return ModelConfig.from_pretrained(os.path.expanduser(str(m["path"])))
    if m.get("arch"):
        return model_config_from_arch(m["arch"])
    raise ConfigError("model.path=None: give a checkpoint directory or a preset with model.arch")
