"""One typed config tree: frozen dataclasses validated in ``__post_init__``.

Hydra is only the front door (``megainfer.launch``): it composes YAML and turns it into
these objects. Nothing under ``megainfer/`` imports Hydra. Every validation failure is a
``ConfigError`` (a ``ValueError``) whose message names the offending field and value.

``model.py``: the checkpoint's architecture; ``runtime.py``: how a job runs it; ``replan.py``:
online re-planning; ``serve.py``: the HTTP server; ``base.py``: the error type and the fixed vocabularies.
"""
from .base import (ATTENTION_BACKENDS, DEVICES, DTYPE_NAMES, MLA_FAMILIES,
                   SUPPORTED_FAMILIES, ConfigError)
from .model import ModelConfig, YarnScaling
from .runtime import (DEPLOY_MODES, KV_CACHE_DTYPES, CacheConfig, CommConfig, DeployPlan,
                      DeviceConfig, EplbConfig, LoadConfig, SchedulerConfig,
                      TraceConfig)
from .replan import ReplanConfig
from .serve import ServeConfig

__all__ = ["ConfigError", "YarnScaling", "ModelConfig", "LoadConfig", "DeviceConfig",
           "CacheConfig", "SchedulerConfig", "DeployPlan", "EplbConfig", "CommConfig",
           "TraceConfig", "ReplanConfig", "ServeConfig", "ATTENTION_BACKENDS", "DEVICES", "DTYPE_NAMES",
           "MLA_FAMILIES", "SUPPORTED_FAMILIES", "DEPLOY_MODES", "KV_CACHE_DTYPES"]
