"""Build a model for a role and fill it from a safetensors checkpoint (or seeded dummy weights).

Every tensor in the checkpoint must be known to the architecture in ``config.json`` and have
its shape; every tensor the role needs must be present. Failures are ``CheckpointError``
subclasses naming the tensor and the file. Experts load per expert (transformers 5 layout:
``mlp.experts.N.gate_proj`` / ``block_sparse_moe.experts.N.w1``) or fused 3-D
(``mlp.experts.gate_up_proj [E, 2N, H]``, ``mlp.experts.down_proj [E, H, N]``).
Only safetensors: no pickle is ever loaded.
"""
from __future__ import annotations

import glob
import json
import os
import zlib
from typing import Optional, Sequence

import torch

from megainfer.config import LoadConfig, ModelConfig

from .layers import ParallelContext
from .mixtral import MIXTRAL
from .model import MoECausalLM
from .qwen2_moe import QWEN2_MOE
from .qwen3_moe import QWEN3_MOE

FAMILIES = {f.name: f for f in (MIXTRAL, QWEN3_MOE, QWEN2_MOE)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint does not fit the model; the message names the tensor and the file."""


class MissingTensorError(CheckpointError):
    pass


class UnexpectedTensorError(CheckpointError):
    pass


class ShapeMismatchError(CheckpointError):
    pass


class CorruptCheckpointError(CheckpointError):
    pass


class ConfigMismatchError(CheckpointError):
    pass


def build_model(cfg: ModelConfig, load: LoadConfig, par: ParallelContext = ParallelContext(),
                role: str = "full", expert_slots: Optional[Sequence[Sequence[int]]] = None,
                phy2log: Optional[Sequence[Sequence[int]]] = None) -> MoECausalLM:
    """A model for ``role`` with weights loaded. ``expert_slots[l]``: physical slots held on
    layer l; ``phy2log[l][slot]``: the logical expert stored in a slot (default: identity)."""
    dtype = DTYPES[load.dtype]
    num_slots = len(phy2log[0]) if phy2log is not None else cfg.num_experts
    model = MoECausalLM(cfg, par, role, expert_slots, num_slots)
    if load.load_format == "dummy":
        _fill_dummy(model, cfg, load.seed, phy2log)
    else:
        _load_safetensors(model, cfg, load.path, phy2log)
    return model.to(dtype).eval().requires_grad_(False)


# ----------------------------------------------------------------------------- dummy weights
def _seeded(name: str, shape, seed: int, std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) ^ seed) & 0x7FFFFFFF)
    return torch.randn(shape, generator=g) * std


def _fill_dummy(model: MoECausalLM, cfg: ModelConfig, seed: int, phy2log) -> None:
    """Random weights seeded by parameter name, so every rank draws the same tensor for a name
    whatever its role; experts by (layer, logical expert)."""
    for name, p in model.named_parameters():
        if name.endswith(("gate_up_proj", "down_proj")) and ".mlp.experts." in name:
            continue
        if name.endswith("norm.weight"):
            full = torch.ones(_full_shape(p))
        else:
            shape = _full_shape(p)
            full = _seeded(name, shape, seed, 1.0 if "embed" in name else shape[-1] ** -0.5)
        _copy(p, full, name, "<dummy>")
    for layer, ex in _expert_modules(model):
        for local, slot in enumerate(ex.slots):
            e = _logical(phy2log, layer, slot)
            base = f"model.layers.{layer}.mlp.experts.{e}"
            H, N = cfg.hidden_size, cfg.moe_intermediate_size
            ex.gate_up_proj.data[local] = _seeded(base + ".gate_up", (2 * N, H), seed, H ** -0.5)
            ex.down_proj.data[local] = _seeded(base + ".down", (H, N), seed, N ** -0.5)


# ----------------------------------------------------------------------------- safetensors
def _checkpoint_files(path: str) -> dict[str, str]:
    """tensor name -> file, from the index when there is one, else from every *.safetensors."""
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if os.path.isfile(index):
        with open(index) as f:
            wmap = json.load(f)["weight_map"]
        return {n: os.path.join(path, fn) for n, fn in wmap.items()}
    if not files:
        raise CheckpointError(f"model.path={path!r}: no *.safetensors files "
                              "(only safetensors checkpoints are loaded)")
    where = {}
    for fn in files:
        try:
            with safe_open(fn, "pt") as f:
                where.update({n: fn for n in f.keys()})
        except Exception as e:  # header unreadable: truncated or not safetensors
            raise CorruptCheckpointError(f"{fn}: cannot read safetensors header ({e})") from e
    return where


class _Reader:
    """Reads tensors by name, keeping files open; wraps every failure with tensor and file."""

    def __init__(self, where: dict[str, str]):
        self.where, self.handles = where, {}

    def _open(self, name: str):
        from safetensors import safe_open
        fn = self.where[name]
        if fn not in self.handles:
            self.handles[fn] = safe_open(fn, "pt")
        return self.handles[fn].get_slice(name)

    def get(self, name: str, index: Optional[int] = None) -> torch.Tensor:
        """The tensor, or its index-th row (one expert of a fused tensor)."""
        try:
            sl = self._open(name)
            return sl[index] if index is not None else sl[:]
        except Exception as e:
            raise CorruptCheckpointError(f"tensor {name!r} in {self.where[name]}: cannot be read "
                                         f"({e})") from e

    def shape(self, name: str) -> tuple:
        try:
            return tuple(self._open(name).get_shape())
        except Exception as e:
            raise CorruptCheckpointError(f"tensor {name!r} in {self.where[name]}: cannot be read "
                                         f"({e})") from e


def _load_safetensors(model: MoECausalLM, cfg: ModelConfig, path: str, phy2log) -> None:
    fam = FAMILIES[cfg.family]
    where = _checkpoint_files(path)
    reader = _Reader(where)
    with torch.device("meta"):
        ref = dict(MoECausalLM(cfg).named_parameters())  # full-model names and shapes
    params = dict(model.named_parameters())
    experts: dict[tuple[int, int], dict[str, str]] = {}  # (layer, e) -> part -> ckpt name
    fused: dict[tuple[int, str], str] = {}  # (layer, gate_up_proj|down_proj) -> ckpt name
    loaded = set()
    for ck_name in sorted(where):
        name = fam.canonical(ck_name)
        fn = where[ck_name]
        parsed = fam.parse_expert(name)
        if parsed is not None:
            _note_expert(parsed, ck_name, fn, cfg, reader, experts, fused)
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name not in ref:
            _unexpected(ck_name, fn, cfg)
        shape = reader.shape(ck_name)
        if shape != tuple(ref[name].shape):
            raise ShapeMismatchError(f"tensor {ck_name!r} in {fn}: shape {list(shape)}, model "
                                     f"expects {list(ref[name].shape)} from config.json")
        if name in params:
            _copy(params[name], reader.get(ck_name), ck_name, fn)
            loaded.add(name)
    for name in params:
        if name not in loaded and not (".mlp.experts." in name):
            raise MissingTensorError(f"tensor {name!r} missing from checkpoint {path}")
    _load_experts(model, cfg, reader, experts, fused, phy2log, path)


def _note_expert(parsed, ck_name, fn, cfg, reader, experts, fused):
    layer, e, part = parsed
    if layer >= cfg.num_layers or not cfg.is_moe_layer(layer):
        raise ConfigMismatchError(f"tensor {ck_name!r} in {fn}: config.json has no MoE layer {layer}")
    H, N, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    if e is None:
        want = (E, 2 * N, H) if part == "gate_up_proj" else (E, H, N)
        fused[(layer, part)] = ck_name
    else:
        if e >= E:
            raise ConfigMismatchError(f"tensor {ck_name!r} in {fn}: expert {e} but config.json "
                                      f"says num_experts={E}")
        want = (H, N) if part == "down" else (N, H)
        experts.setdefault((layer, e), {})[part] = ck_name
    shape = reader.shape(ck_name)
    if shape != want:
        raise ShapeMismatchError(f"tensor {ck_name!r} in {fn}: shape {list(shape)}, model expects "
                                 f"{list(want)} from config.json")


def _load_experts(model, cfg, reader, experts, fused, phy2log, path):
    for layer, ex in _expert_modules(model):
        for local, slot in enumerate(ex.slots):
            e = _logical(phy2log, layer, slot)
            gu, down = _expert_weights(cfg, reader, experts, fused, layer, e, path)
            ex.gate_up_proj.data[local].copy_(gu)
            ex.down_proj.data[local].copy_(down)


def _expert_weights(cfg, reader, experts, fused, layer, e, path):
    """(gate_up [2N, H], down [H, N]) of logical expert e on layer."""
    if (layer, "gate_up_proj") in fused and (layer, "down_proj") in fused:
        return (reader.get(fused[(layer, "gate_up_proj")], e),
                reader.get(fused[(layer, "down_proj")], e))
    parts = experts.get((layer, e), {})
    for part in ("gate", "up", "down"):
        if part not in parts:
            raise MissingTensorError(f"expert {e} {part} projection of layer {layer} missing from "
                                     f"checkpoint {path} (looked for per-expert and fused layouts)")
    return (torch.cat([reader.get(parts["gate"]), reader.get(parts["up"])], 0),
            reader.get(parts["down"]))


def _unexpected(ck_name, fn, cfg):
    import re
    m = re.match(r"^model\.layers\.(\d+)\.", ck_name)
    if m and int(m.group(1)) >= cfg.num_layers:
        raise ConfigMismatchError(f"tensor {ck_name!r} in {fn}: layer {m.group(1)} but config.json "
                                  f"says num_hidden_layers={cfg.num_layers}")
    raise UnexpectedTensorError(f"tensor {ck_name!r} in {fn}: not part of a {cfg.family} model "
                                "with this config.json")


# ----------------------------------------------------------------------------- helpers
def _expert_modules(model):
    for i, layer in enumerate(model.layers):
        mlp = getattr(layer, "mlp", None)
        ex = getattr(mlp, "experts", None)
        if ex is not None and len(ex.slots):
            yield i, ex


def _logical(phy2log, layer: int, slot: int) -> int:
    return slot if phy2log is None else int(phy2log[layer][slot])


def _full_shape(p: torch.Tensor) -> tuple:
    shard = getattr(p, "tp_shard", None)
    if shard is None:
        return tuple(p.shape)
    dim, _, full = shard
    shape = list(p.shape)
    shape[dim] = full
    return tuple(shape)


def _copy(p: torch.Tensor, full: torch.Tensor, name: str, fn: str) -> None:
    """Copy the full checkpoint tensor, or this rank's tensor-parallel slice of it, into p."""
    shard = getattr(p, "tp_shard", None)
    src = full if shard is None else full.narrow(shard[0], shard[1].start,
                                                 shard[1].stop - shard[1].start)
    if tuple(src.shape) != tuple(p.shape):
        raise ShapeMismatchError(f"tensor {name!r} in {fn}: shape {list(full.shape)} does not fit "
                                 f"parameter of shape {list(p.shape)}")
    p.data.copy_(src)
