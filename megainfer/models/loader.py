"""Build a model for a role and fill it from a safetensors checkpoint (or seeded dummy weights).

Invariants: every checkpoint tensor must be known to the architecture in ``config.json`` with
its shape, and every tensor the role needs must be present; failures are ``CheckpointError``
subclasses naming the tensor and the file. Experts load per expert or fused 3-D. Only
safetensors: no pickle is ever loaded. No host copy of the model: built on the meta device,
each parameter allocated once on the target device and dtype, each tensor (or the rows a rank
needs) read with plain reads (``safetensors_io``) into the parameter or one reusable scratch
buffer. Peak memory: the model + its largest tensor. docs/gpu.md, "Loading without a host
copy"."""
from __future__ import annotations

import contextlib
import logging
from typing import Optional, Sequence, Union

import torch
from torch import nn

from megainfer.config import LoadConfig, ModelConfig

from .checkpoint_errors import (CheckpointError, ConfigMismatchError, CorruptCheckpointError,
                                MissingTensorError, ShapeMismatchError, UnexpectedTensorError)
from .checkpoint_reader import CheckpointReader, checkpoint_files
from .deepseek_v3 import DEEPSEEK_V2, DEEPSEEK_V3
from .layers import ParallelContext
from .mixtral import MIXTRAL
from .model import MoECausalLM
from .qwen2_moe import QWEN2_MOE
from .qwen3_moe import QWEN3_MOE
from .fp8 import QuantConfig
from .dummy_weights import expert_modules as _expert_modules, fill_dummy as _fill_dummy
from .dummy_weights import logical as _logical
from .quant_load import check_stored_experts, load_quant_expert, load_quant_linear, report_bytes
from .quant_linear import QuantLinear
from .quant_weights import apply_weight_format, weight_format_for

FAMILIES = {f.name: f for f in (MIXTRAL, QWEN3_MOE, QWEN2_MOE, DEEPSEEK_V2, DEEPSEEK_V3)}
__all__ = ["build_model", "weight_bytes", "FAMILIES", "CheckpointError", "ConfigMismatchError",
           "CorruptCheckpointError", "MissingTensorError", "ShapeMismatchError",
           "UnexpectedTensorError"]
log = logging.getLogger("megainfer.models")


def build_model(cfg: ModelConfig, load: LoadConfig, par: ParallelContext = ParallelContext(),
                role: str = "full", expert_slots: Optional[Sequence[Sequence[int]]] = None,
                phy2log: Optional[Sequence[Sequence[int]]] = None,
                device: Union[str, torch.device] = "cpu") -> MoECausalLM:
    """A model for ``role`` with weights loaded on ``device`` in ``load.dtype``.
    ``expert_slots[l]``: physical slots held on layer l; ``phy2log[l][slot]``: the logical expert
    stored in a slot (default: identity).

    The module is built on the meta device, every parameter is then allocated once on
    ``device`` in the target dtype and filled tensor by tensor: no host copy of the model, no
    fp32 staging. Peak memory is the model plus at most its largest tensor. Linear and expert
    weights are kept in ``load.quantization``'s format (``quant_weights.py``), swapped in on
    the meta model, so a shape the format refuses is refused before any weight is read."""
    dtype, device = load.torch_dtype, torch.device(device)
    num_slots = len(phy2log[0]) if phy2log is not None else cfg.num_experts
    fmt = load_weight_format(load)
    with _on_meta():
        model = MoECausalLM(cfg, par, role, expert_slots, num_slots)
        apply_weight_format(model, fmt)
    _materialize(model, dtype, device)
    with torch.no_grad():
        if load.load_format == "dummy":
            _fill_dummy(model, cfg, load.seed, phy2log)
        else:
            _load_safetensors(model, cfg, load.path, phy2log)
    report_bytes(model, role, fmt, dtype)
    return model.eval().requires_grad_(False)


def load_weight_format(load: LoadConfig):
    """The format ``load`` keeps linear and expert weights in (None: the model dtype)."""
    ckpt = QuantConfig.from_pretrained(load.path) if load.load_format != "dummy" else None
    return weight_format_for(load.quantization, load.quantization_group_size, ckpt)


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, par: ParallelContext = ParallelContext(),
                 role: str = "full", load: Optional[LoadConfig] = None) -> int:
    """Bytes the weights of ``role`` take in ``dtype`` (router weights kept float32 counted so;
    with ``load``, linear and expert weights in its format), counted on the meta device:
    nothing is allocated."""
    with _on_meta():
        model = MoECausalLM(cfg, par, role)
        if load is not None:
            apply_weight_format(model, load_weight_format(load))
    return sum(p.numel() * (4 if getattr(p, "keep_fp32", False) else p.element_size()
                            if getattr(p, "quant_storage", False) else dtype.itemsize)
               for p in model.parameters())


@contextlib.contextmanager
def _on_meta():
    """Build modules on the meta device without running their random initialisers (which on
    meta go through torch's Python reference kernels: ~2 s and ~165 MB of imports)."""
    saved = [(cls, cls.reset_parameters) for cls in (nn.Linear, nn.Embedding)]
    try:
        for cls, _ in saved:
            cls.reset_parameters = lambda self: None
        with torch.device("meta"):
            yield
    finally:
        for cls, fn in saved:
            cls.reset_parameters = fn


def _materialize(model: MoECausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter with one of real (uninitialised) storage on device in dtype
    (``.data`` cannot change a meta tensor's device). A parameter shared by two modules (tied
    embeddings) gets one replacement in both; attributes such as ``tp_shard`` are carried over.
    Then every module with ``init_buffers`` recomputes its non-persistent buffers there."""
    new: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(old) -> (old kept alive, new)
    for mod in model.modules():
        for key, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) not in new:  # keep_fp32: router weights that stay float32 (as HF keeps them)
                # quant_storage: a weight kept in its stored format (int8, fp8, packed int4)
                dt = (torch.float32 if getattr(p, "keep_fp32", False) else
                      p.dtype if getattr(p, "quant_storage", False) else dtype)
                q = nn.Parameter(torch.empty(p.shape, dtype=dt, device=device),
                                 requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)
                new[id(p)] = (p, q)
            mod._parameters[key] = new[id(p)][1]
    for mod in model.modules():
        if hasattr(mod, "init_buffers"):
            mod.init_buffers(device)
        if hasattr(mod, "compute_dtype"):  # experts whose weights may be kept quantised
            mod.compute_dtype = dtype
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"buffers {left} are still on the meta device: their module needs an "
                           "init_buffers(device) method")


# ----------------------------------------------------------------------------- safetensors
def _load_safetensors(model: MoECausalLM, cfg: ModelConfig, path: str, phy2log) -> None:
    fam = FAMILIES[cfg.family]
    where, opened = checkpoint_files(path)
    pin = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
    reader = CheckpointReader(where, opened, pin)
    try:
        check_stored_experts(where, model, cfg.moe_intermediate_size)
        _load_all(model, cfg, path, phy2log, fam, where, reader)
    finally:
        reader.close()


def _load_all(model, cfg, path, phy2log, fam, where, reader) -> None:
    with _on_meta():
        ref = dict(MoECausalLM(cfg).named_parameters())  # full-model names and shapes
    params = dict(model.named_parameters())
    qlin = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    experts: dict[tuple[int, int], dict[str, str]] = {}  # (layer, e) -> part -> ckpt name
    fused: dict[tuple[int, str], str] = {}  # (layer, gate_up_proj|down_proj) -> ckpt name
    loaded, mtp = set(), []
    for ck_name in sorted(where):
        name = fam.canonical(ck_name)
        fn = where[ck_name]
        if _is_mtp(name, cfg):
            mtp.append(ck_name)
            continue
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
        if name in qlin:  # kept quantised: weight and its scale
            load_quant_linear(reader, ck_name, qlin[name])
            loaded.update((name, name + qlin[name].fmt.scale_name))
        elif name in params:
            reader.read_param(ck_name, params[name])
            loaded.add(name)
    if mtp:
        log.info("skipped %d tensors of the multi-token-prediction layer(s) %d..%d (not served)",
                 len(mtp), cfg.num_layers, cfg.num_layers + cfg.mtp_layers - 1)
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
    """Each held slot reads only its logical expert: one row of a fused [E, ...] tensor, or the
    per-expert gate and up into the two halves of gate_up and down as is."""
    N = cfg.moe_intermediate_size
    for layer, ex in _expert_modules(model):
        gu_all, dn_all = ex.gate_up_proj.data, ex.down_proj.data
        quant = ex.quantised
        for local, slot in enumerate(ex.slots):
            e = _logical(phy2log, layer, slot)
            src = _expert_source(layer, e, fused, experts, path)
            if quant:
                load_quant_expert(reader, ex, local, e, src)
                continue
            if src[0] == "fused":
                row = (e, e + 1)
                reader.read(src[1], gu_all[local:local + 1], rows=row)
                reader.read(src[2], dn_all[local:local + 1], rows=row)
                continue
            parts = dict(zip(("gate", "up", "down"), src[1:]))
            reader.read(parts["gate"], gu_all[local, :N])
            reader.read(parts["up"], gu_all[local, N:])
            reader.read(parts["down"], dn_all[local])


def _expert_source(layer: int, e: int, fused: dict, experts: dict, path: str) -> tuple:
    """Where logical expert ``e`` of ``layer`` is in the checkpoint: ('fused', gate_up name,
    down name) of [E, ...] tensors, or ('split', gate, up, down) per-expert tensors."""
    if (layer, "gate_up_proj") in fused and (layer, "down_proj") in fused:
        return "fused", fused[(layer, "gate_up_proj")], fused[(layer, "down_proj")]
    parts = experts.get((layer, e), {})
    for part in ("gate", "up", "down"):
        if part not in parts:
            raise MissingTensorError(f"expert {e} {part} projection of layer {layer} "
                                     f"missing from checkpoint {path} (looked for "
                                     "per-expert and fused layouts)")
    return "split", parts["gate"], parts["up"], parts["down"]


def _is_mtp(name: str, cfg) -> bool:
    """A tensor of DeepSeek's MTP layers ``model.layers.<num_layers + i>.*`` (i < mtp_layers)."""
    if not cfg.mtp_layers or not name.startswith("model.layers."):
        return False
    idx = name.split(".", 3)[2]
    return idx.isdigit() and cfg.num_layers <= int(idx) < cfg.num_layers + cfg.mtp_layers


def _unexpected(ck_name, fn, cfg):
    import re
    m = re.match(r"^model\.layers\.(\d+)\.", ck_name)
    if m and int(m.group(1)) >= cfg.num_layers:
        raise ConfigMismatchError(f"tensor {ck_name!r} in {fn}: layer {m.group(1)} but config.json "
                                  f"says num_hidden_layers={cfg.num_layers}")
    raise UnexpectedTensorError(f"tensor {ck_name!r} in {fn}: not part of a {cfg.family} model "
                                "with this config.json")
