"""Checkpoint files -> tensors in parameters: which file holds each tensor (the index, else
every ``*.safetensors``), and a reader that puts a tensor (or some of its rows) into a parameter
on any device without a host copy of the model. Failures are ``CheckpointError`` subclasses
naming the tensor and the file.

FP8 block-quantised checkpoints (``fp8.py``) are read as their logical, dequantised tensors:
``checkpoint_files`` leaves the ``*.weight_scale_inv`` scales out of the name map (keeping them
on the side, with the ``quantization_config``), and the reader, asked for a float8 weight or rows
of it, reads the matching scale rows too and delivers float32 values cast once to the
parameter's dtype."""
from __future__ import annotations

import glob
import json
import math
import os
from typing import Optional

import torch

from .checkpoint_errors import (CheckpointError, ConfigMismatchError,
                                CorruptCheckpointError, MissingTensorError, ShapeMismatchError,
                                UnexpectedTensorError)
from .fp8 import (FP8_DTYPES, QuantConfig, check_scale_shape, check_scale_values,
                  dequantize_blockwise, is_scale_name, scale_name, weight_name)
from .safetensors_io import Scratch, SafetensorsFile, SafetensorsFormatError, TensorInfo


def _open_file(fn: str, name: Optional[str] = None) -> SafetensorsFile:
    """Open and validate a file's header (``name``: the tensor it was opened for)."""
    try:
        return SafetensorsFile(fn)
    except SafetensorsFormatError as e:
        what = f"tensor {name!r} in {fn}: " if name is not None else ""
        raise CorruptCheckpointError(f"{what}cannot read safetensors header: {e}") from e


class CheckpointMap(dict):
    """Logical tensor name -> file: what the loader iterates. Block scales of fp8 weights are
    not in it: ``scales`` maps a weight's name to (its scale's name, the scale's file), and
    ``quant`` is the checkpoint's ``QuantConfig`` (None when config.json has none)."""

    def __init__(self, items=(), scales: Optional[dict] = None,
                 quant: Optional[QuantConfig] = None):
        super().__init__(items)
        self.scales = scales or {}
        self.quant = quant


def checkpoint_files(path: str) -> tuple[CheckpointMap, dict[str, SafetensorsFile]]:
    """(tensor name -> file, from the index when there is one, else from every *.safetensors;
    the files already opened). The map is logical: fp8 block scales are held on its side."""
    quant = QuantConfig.from_pretrained(path)  # a bad quantization_config: before any file
    where, opened = _raw_checkpoint_files(path)
    try:
        return _logical(where, quant), opened
    except BaseException:
        for f in opened.values():
            f.close()
        raise


def _logical(where: dict[str, str], quant: Optional[QuantConfig]) -> CheckpointMap:
    out = CheckpointMap({n: fn for n, fn in where.items() if not is_scale_name(n)}, quant=quant)
    for n, fn in where.items():
        if is_scale_name(n):
            w = weight_name(n)
            if w not in out:
                raise UnexpectedTensorError(f"tensor {n!r} in {fn}: a block scale without its "
                                            f"weight {w!r} in the checkpoint")
            out.scales[w] = (n, fn)
    return out


def _raw_checkpoint_files(path: str) -> tuple[dict[str, str], dict[str, SafetensorsFile]]:
    index = os.path.join(path, "model.safetensors.index.json")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if os.path.isfile(index):
        try:
            with open(index) as f:
                wmap = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{index}: not a safetensors index ({e!r})") from e
        return {n: os.path.join(path, fn) for n, fn in wmap.items()}, {}
    if not files:
        raise CheckpointError(f"model.path={path!r}: no *.safetensors files "
                              "(only safetensors checkpoints are loaded)")
    where, opened = {}, {}
    try:
        for fn in files:
            opened[fn] = _open_file(fn)
            where.update({n: fn for n in opened[fn].keys()})
    except BaseException:
        for f in opened.values():
            f.close()
        raise
    return where, opened


class CheckpointReader:
    """Reads tensors by name straight into parameters, keeping files open; wraps every failure
    with tensor and file. Bytes go by ``readinto`` into the parameter itself when it is on the
    host in the checkpoint's dtype, else into one reusable host scratch buffer (pinned for a
    CUDA target) and from there are copied (and converted) into the parameter. For a device
    target needing a conversion or a column slice, the host converts into a second pinned
    buffer first; the device then gets one contiguous DMA."""

    def __init__(self, where: dict[str, str], opened: dict[str, SafetensorsFile], pin: bool):
        self.where, self.files = where, dict(opened)
        self.scales = getattr(where, "scales", {})  # weight name -> (scale name, file)
        self.quant = getattr(where, "quant", None)
        self.scratch, self.staged = Scratch(pin), Scratch(pin)  # staged: device targets only

    def _info(self, name: str, fn: Optional[str] = None) -> tuple[SafetensorsFile, TensorInfo]:
        fn = self.where[name] if fn is None else fn
        if fn not in self.files:
            self.files[fn] = _open_file(fn, name)
        f = self.files[fn]
        try:
            return f, f.info(name)
        except SafetensorsFormatError as e:  # the message names tensor and file
            raise CorruptCheckpointError(str(e)) from e

    def shape(self, name: str) -> tuple:
        """The logical shape (a float8 weight's own; its block scale is checked here too)."""
        f, t = self._info(name)
        if t.dtype in FP8_DTYPES or name in self.scales:
            self._scale_info(name, f, t)
        return t.shape

    def _scale_info(self, name: str, f: SafetensorsFile, t: TensorInfo):
        """(scale's file, scale's info, block) of a float8 weight, all checked against it."""
        where = f"tensor {name!r} in {f.path}"
        if t.dtype not in FP8_DTYPES:
            raise CorruptCheckpointError(f"{where}: has a block scale {scale_name(name)!r} but "
                                         f"is {t.dtype}, not float8")
        if name not in self.scales:
            raise MissingTensorError(f"{where}: float8 weight without its block scale "
                                     f"{scale_name(name)!r} in the checkpoint")
        q = self.quant
        if q is None:
            raise ConfigMismatchError(f"{where}: float8 weight but config.json has no "
                                      "quantization_config (block size unknown)")
        if t.dtype != q.dtype:
            raise CorruptCheckpointError(f"{where}: {t.dtype} but config.json "
                                         f"quantization_config.fmt={q.fmt!r}")
        sname, sfn = self.scales[name]
        sf, st = self._info(sname, sfn)
        if not st.dtype.is_floating_point or st.dtype in FP8_DTYPES:
            raise CorruptCheckpointError(f"tensor {sname!r} in {sf.path}: block scale of dtype "
                                         f"{st.dtype}; expected float32/bfloat16/float16")
        check_scale_shape(name, t.shape, st.shape, q.block, f.path, sname=sname)
        return sf, st, q.block

    def stored_format(self, name: str) -> Optional[tuple]:
        """(float8 dtype, block) of a tensor stored block-quantised, else None."""
        f, t = self._info(name)
        if t.dtype not in FP8_DTYPES and name not in self.scales:
            return None
        _, _, block = self._scale_info(name, f, t)
        return t.dtype, tuple(block)

    def read_stored(self, name: str, rows: Optional[tuple[int, int]] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A float8 weight as stored, or rows [r0, r1) of its dim 0: (fresh float8 tensor,
        float32 scale rows the slice touches; for a 2-D weight from block row r0 // bo, so a
        slice that starts mid-block needs ``row0`` to be read)."""
        f, t = self._info(name)
        w, scale, _, _ = self._stored(name, f, t, rows)
        return w.clone(), scale

    def _stored(self, name: str, f: SafetensorsFile, t: TensorInfo,
                rows: Optional[tuple[int, int]]):
        """(float8 rows in the scratch buffer, float32 scale rows, block, row0) of a float8
        weight: the fp8 bytes go through the scratch buffer, the scale rows the slice touches
        (for a 2-D weight, from block row r0 // bo) into a small tensor of their own."""
        sf, st, block = self._scale_info(name, f, t)
        sname = st.name
        row0, srows = 0, rows
        if rows is not None and len(t.shape) == 2:  # dim 0 is the blocked row dim
            row0, srows = rows[0], (rows[0] // block[0], -(-rows[1] // block[0]))
        shape = list(t.shape) if rows is None else [rows[1] - rows[0]] + list(t.shape[1:])
        sshape = list(st.shape) if srows is None else [srows[1] - srows[0]] + list(st.shape[1:])
        try:
            w = f.read_into(name, self.scratch.get(math.prod(shape) * t.dtype.itemsize), rows)
            sbuf = torch.empty(math.prod(sshape) * st.dtype.itemsize, dtype=torch.uint8)
            scale = sf.read_into(sname, sbuf, srows).to(torch.float32)
        except SafetensorsFormatError as e:  # the message names tensor and file
            raise CorruptCheckpointError(str(e)) from e
        check_scale_values(sname, scale, sf.path)
        return w, scale, block, row0

    def _dequantized(self, name: str, f: SafetensorsFile, t: TensorInfo,
                     rows: Optional[tuple[int, int]]) -> torch.Tensor:
        """The float8 weight, or rows [r0, r1) of its dim 0, dequantised to a new float32
        tensor (``_stored``, then the block scales applied)."""
        w, scale, block, row0 = self._stored(name, f, t, rows)
        return dequantize_blockwise(w, scale, block, torch.float32, row0=row0, name=name)

    def read(self, name: str, dst: torch.Tensor, rows: Optional[tuple[int, int]] = None,
             narrow: Optional[tuple[int, int, int]] = None) -> None:
        """dst <- the tensor, or rows [r0, r1) of its dim 0, then optionally ``.narrow(*narrow)``
        (a column slice needs the whole tensor read first). A float8 weight is dequantised
        (float32, then one cast to dst's dtype)."""
        f, t = self._info(name)
        shape = list(t.shape) if rows is None else [rows[1] - rows[0]] + list(t.shape[1:])
        want = list(shape)
        if narrow is not None:
            want[narrow[0]] = narrow[2]
        if want != list(dst.shape):
            raise ShapeMismatchError(f"tensor {name!r} in {f.path}: shape {list(t.shape)} does "
                                     f"not fit parameter of shape {list(dst.shape)}")
        if t.dtype in FP8_DTYPES or name in self.scales:
            src = self._dequantized(name, f, t, rows)
        else:
            try:
                if (narrow is None and dst.device.type == "cpu" and dst.dtype == t.dtype
                        and dst.is_contiguous()):
                    f.read_into(name, dst, rows)  # straight into the parameter
                    return
                nbytes = math.prod(shape) * t.dtype.itemsize
                src = f.read_into(name, self.scratch.get(nbytes), rows)
            except SafetensorsFormatError as e:  # the message names tensor and file
                raise CorruptCheckpointError(str(e)) from e
        if narrow is not None:
            src = src.narrow(*narrow)
        if dst.device.type != "cpu" and (src.dtype != dst.dtype or not src.is_contiguous()):
            src = self._stage(src, dst.dtype)
        dst.copy_(src)  # blocking: the scratch buffers are free again afterwards

    def _stage(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """src converted to dtype, contiguous, in the second (pinned) host buffer: the copy to
        the device is then one DMA (copy_ would otherwise make an unpinned host temporary)."""
        nbytes = src.numel() * dtype.itemsize
        out = self.staged.get(nbytes)[:nbytes].view(dtype).view(src.shape)
        return out.copy_(src)

    def read_param(self, name: str, p: torch.Tensor) -> None:
        """p <- the checkpoint tensor, or this rank's tensor-parallel slice of it."""
        shard = getattr(p, "tp_shard", None)
        if shard is None:
            self.read(name, p.data)
            return
        dim, sl, _ = shard
        if dim == 0:
            self.read(name, p.data, rows=(sl.start, sl.stop))
        else:
            self.read(name, p.data, narrow=(dim, sl.start, sl.stop - sl.start))

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()
        self.scratch.release()
        self.staged.release()
