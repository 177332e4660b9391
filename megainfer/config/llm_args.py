"""``LLM(...)``'s arguments (vLLM's names where they mean the same) -> the launcher's config tree
(``engine/resolve.py`` reads both), and back: a ``ConfigError`` the resolution raises names the Python
argument the bad value came from (``LLM(max_num_seqs=0): scheduler.max_num_seqs=0: ...``)."""
from __future__ import annotations

import re
from typing import Mapping, Optional, Sequence, Union

from .base import ConfigError
from .presets import load_preset, parse_override

# LLM argument -> the config key it sets (seed also seeds dummy weights: model.seed)
ARG_KEYS = {
    "model": "model.path", "revision": "model.revision", "load_format": "model.load_format",
    "dtype": "model.dtype", "attention_backend": "model.attention_backend",
    "seed": "sampling.seed", "device": "deploy.device", "cpu_threads": "deploy.cpu_threads",
    "tensor_parallel_size": "deploy.attention_tp", "cuda_graphs": "engine.cuda_graphs",
    "max_model_len": "scheduler.max_model_len", "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "enable_chunked_prefill": "scheduler.enable_chunked_prefill",
    "block_size": "cache.block_size", "num_blocks": "cache.num_blocks",
    "kv_cache_memory_gib": "cache.memory_gib",
    "gpu_memory_utilization": "cache.gpu_memory_utilization",
    "enable_prefix_caching": "cache.enable_prefix_caching", "kv_cache_dtype": "cache.kv_cache_dtype",
    "host_kv_gib": "cache.host_kv_gib", "kv_store_dir": "cache.kv_store_dir",
    "kv_scale_granularity": "cache.kv_scale_granularity", "quantization": "model.quantization",
}
_LEADING_KEY = re.compile(r"^([A-Za-z_][\w]*(?:\.[\w]+)+)=")
_OFFLINE_GROUPS = ("io", "workload")


def llm_tree(args: Mapping, deploy: Union[None, str, Mapping] = None,
             overrides: Sequence[str] = ()) -> tuple[dict, dict]:
    """(config tree, origin): ``args`` (LLM argument -> value; ``None``: not given) laid out
    as ``group.key`` values, then ``deploy`` (a conf/deploy preset name or a mapping of
    ``deploy.*`` keys), then ``overrides``. ``origin``: config key -> the argument that set it."""
    tree: dict = {}
    origin: dict = {}
    if isinstance(deploy, str):
        _set_group(tree, origin, "deploy", load_preset("deploy", deploy, "deploy"),
                   f"deploy={deploy!r}")
    elif isinstance(deploy, Mapping):
        _set_group(tree, origin, "deploy", deploy, f"deploy={dict(deploy)!r}")
    elif deploy is not None:
        raise ConfigError(f"deploy={deploy!r}: give a preset name (conf/deploy: e.g. 'a1e2', "
                          "'colocated2', 'auto') or a mapping of deploy.* keys")
    for name, value in args.items():
        if value is None:
            continue
        group, key = ARG_KEYS[name].split(".")
        tree.setdefault(group, {})[key] = value
        origin[ARG_KEYS[name]] = f"{name}={value!r}"
    if args.get("seed") is not None:
        tree.setdefault("model", {})["seed"] = args["seed"]
        origin["model.seed"] = f"seed={args['seed']!r}"
    if isinstance(overrides, str):
        raise ConfigError(f"overrides={overrides!r}: give a list of group.key=value strings")
    for item in overrides:
        path, value = parse_override(item, "overrides")
        if path[0] in _OFFLINE_GROUPS or (path[0] == "sampling" and path[1:] != ["seed"]):
            raise ConfigError(f"overrides={item!r}: {path[0]}.* is the offline job's "
                              "(megainfer-launch); with LLM give SamplingParams to generate() "
                              "and the prompts themselves (sampling.seed: LLM(seed=...))")
        node = tree
        for p in path[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"overrides={item!r}: {p} is not a group")
        node[path[-1]] = value
        origin[".".join(path)] = f"overrides=[{item!r}]"
    return tree, origin


def _set_group(tree: dict, origin: dict, group: str, d: Mapping, why: str) -> None:
    tree.setdefault(group, {}).update(d)
    for k in d:
        origin[f"{group}.{k}"] = why


def named_error(e: ConfigError, origin: Mapping[str, str], world: Optional[str]) -> ConfigError:
    """``e`` (same type) with the LLM argument its key came from in front: the exact key's
    origin, else its group's (``deploy``, ``model``), else ``world`` for a world-size misfit."""
    msg = str(e)
    m = _LEADING_KEY.match(msg)
    key = m.group(1) if m else ("model.path" if msg.startswith("config.json") else None)
    why = origin.get(key) if key else None
    if why is None and key:
        group = key.split(".")[0]
        hits = sorted({v for k, v in origin.items() if k.split(".")[0] == group})
        why = ", ".join(hits) if hits and group in ("deploy", "model") else None
    if why is None and msg.startswith("world size"):
        why = ", ".join(sorted({v for k, v in origin.items() if k.startswith("deploy.")})
                        + ([world] if world else [])) or None
    if why is None:
        return e
    return type(e)(f"LLM({why}): {msg}")

