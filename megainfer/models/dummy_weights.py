"""Dummy weights (``model.load_format=dummy``): every parameter drawn from a generator seeded by
its name, so every rank draws the same tensor for a name whatever its role (experts by layer
and logical expert), one tensor at a time on the host; weights kept in a stored format are
drawn in float32 and quantised. Also the small helpers the loader shares with it."""
from __future__ import annotations

import zlib

import torch

from .checkpoint_errors import ShapeMismatchError
from .quant_load import quantised_dummy
from .quant_linear import QuantLinear


def _seeded(name: str, shape, seed: int, std: float) -> torch.Tensor:
    """The full fp32 tensor for a name, on the host (the same values whatever the device)."""
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) ^ seed) & 0x7FFFFFFF)
    return torch.randn(shape, generator=g, device="cpu").mul_(std)


def fill_dummy(model, cfg, seed: int, phy2log) -> None:
    """Random weights seeded by parameter name, so every rank draws the same tensor for a name
    whatever its role; experts by (layer, logical expert). One tensor at a time on the host;
    a quantised weight is drawn in float32 and quantised (``quant_load.quantised_dummy``)."""
    qlin = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    scales = {w + m.fmt.scale_name for w, m in qlin.items()}
    for name, p in model.named_parameters():
        if ".mlp.experts." in name and name.rsplit(".", 1)[1].startswith(("gate_up_proj",
                                                                          "down_proj")):
            continue
        if name in qlin:
            shape = qlin[name].full_shape
            quantised_dummy(qlin[name], _seeded(name, shape, seed, shape[-1] ** -0.5))
            continue
        if name in scales:
            continue
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        shape = _full_shape(p)
        full = _seeded(name, shape, seed, 1.0 if "embed" in name else shape[-1] ** -0.5)
        _copy(p, full, name, "<dummy>")
        del full
    for layer, ex in expert_modules(model):
        for local, slot in enumerate(ex.slots):
            e = logical(phy2log, layer, slot)
            base = f"model.layers.{layer}.mlp.experts.{e}"
            H, N = cfg.hidden_size, cfg.moe_intermediate_size
            gu = _seeded(base + ".gate_up", (2 * N, H), seed, H ** -0.5)
            dn = _seeded(base + ".down", (H, N), seed, N ** -0.5)
            if ex.quantised:
                quantised_dummy(ex, gu, local, "gate_up_proj")
                quantised_dummy(ex, dn, local, "down_proj")
                continue
            ex.gate_up_proj.data[local].copy_(gu)
            ex.down_proj.data[local].copy_(dn)



def expert_modules(model):
    for i, layer in enumerate(model.layers):
        mlp = getattr(layer, "mlp", None)
        ex = getattr(mlp, "experts", None)
        if ex is not None and len(ex.slots):
            yield i, ex


def logical(phy2log, layer: int, slot: int) -> int:
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
