"""The model shapes the perf benches run, read from the shipped presets (one place each).

``preset_model(name)``: ``conf/model/<name>.yaml``'s ``arch`` as a ``ModelConfig``;
``load_shape(name)``: the ``conf/plan_model/<name>.yaml`` preset as the planner's ``ModelShape``;
``BENCH50M``: the ~49M-parameter Mixtral-shaped model most CPU benches run (8 experts top-2,
4 layers), and ``BENCH50M_SHAPE`` its ``ModelShape``.
"""
from __future__ import annotations

import os

import yaml

import megainfer.conf
from megainfer.config import ModelConfig
from megainfer.config.model_source import model_config_from_arch
from megainfer.perfmodel.model.shapes import ModelShape

CONF = os.path.dirname(megainfer.conf.__file__)


def preset_model(name: str) -> ModelConfig:
    with open(os.path.join(CONF, "model", f"{name}.yaml")) as f:
        return model_config_from_arch(yaml.safe_load(f)["arch"])


def load_shape(name: str) -> ModelShape:
    with open(os.path.join(CONF, "plan_model", f"{name}.yaml")) as f:
        d = yaml.safe_load(f)
    return ModelShape.from_dict({k: v for k, v in d.items() if k != "name"}, d.get("name", name))


BENCH50M = preset_model("bench50m")
BENCH50M_SHAPE = ModelShape.from_model_config(BENCH50M, "bench50m")
