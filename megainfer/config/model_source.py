"""``model.path`` or ``model.arch`` -> ``ModelConfig``: a checkpoint's config.json (a directory, or
a model id in the local Hugging Face cache: ``hf_cache.py``), or a preset's architecture written
out key by key (conf/model/*.yaml). The resolution (``resolve.py``) and the planner at launch
both read the model through here."""
from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, Mapping

from .base import ConfigError
from .hf_cache import checkpoint_dir
from .keys import field_names, take
from .model import ModelConfig


def model_config_from_arch(arch: Mapping[str, Any]) -> ModelConfig:
    """``model.arch`` (ModelConfig field names, or a ModelConfig) -> ModelConfig; lists become
    tuples."""
    if isinstance(arch, ModelConfig):
        return arch
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
        return ModelConfig.from_pretrained(checkpoint_dir(m["path"], m.get("revision")))
    if m.get("arch"):
        return model_config_from_arch(m["arch"])
    raise ConfigError("model.path=None: give a checkpoint directory or a preset with model.arch")
