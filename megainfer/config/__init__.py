"""One typed config tree: frozen dataclasses validated in ``__post_init__``.

Hydra is only the front door (``megainfer.launch``): nothing under ``megainfer/`` imports it.
Every validation failure is a ``ConfigError`` (a ``ValueError``) naming the field and value.
``model.py``, ``runtime.py``, ``replan.py``, ``pd.py``, ``slo.py``, ``serve.py``: the groups;
``job.py``: one job's groups in one bundle; ``base.py``: the error type and fixed vocabularies;
``keys.py``, ``deploy_fit.py``, ``model_source.py``, ``hf_cache.py``, ``llm_args.py``: the pieces
the one resolution (``megainfer/engine/resolve.py``) uses. This package imports nothing of
megainfer above it (only ``megainfer.kernels``' limits).
docs/architecture.md, "Module map".
"""
from .base import (ATTENTION_BACKENDS, DEVICES, DTYPE_NAMES, MLA_FAMILIES,
                   SUPPORTED_FAMILIES, ConfigError)
from .model import ModelConfig, YarnScaling
from .runtime import (DEPLOY_MODES, KV_CACHE_DTYPES, CacheConfig, CommConfig, DeployPlan,
                      DeviceConfig, EplbConfig, LoadConfig, SchedulerConfig,
                      TraceConfig)
from .replan import ReplanConfig
from .pd import PdConfig
from .slo import SloConfig
from .serve import ServeConfig
from .job import ResolvedJob

__all__ = ["ConfigError", "YarnScaling", "ModelConfig", "LoadConfig", "DeviceConfig",
           "CacheConfig", "SchedulerConfig", "DeployPlan", "EplbConfig", "CommConfig",
           "TraceConfig", "ReplanConfig", "PdConfig", "SloConfig", "ServeConfig", "ResolvedJob", "ATTENTION_BACKENDS",
           "DEVICES", "DTYPE_NAMES",
           "MLA_FAMILIES", "SUPPORTED_FAMILIES", "DEPLOY_MODES", "KV_CACHE_DTYPES"]
