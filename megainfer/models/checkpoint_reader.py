"""Checkpoint files -> tensors in parameters: which file holds each tensor (the index, else
every ``*.safetensors``), and a reader that puts a tensor (or some of its rows) into a parameter
on any device without a host copy of the model. Failures are ``CheckpointError`` subclasses
naming the tensor and the file."""
from __future__ import annotations

import glob
import json
import math
import os
from typing import Optional

import torch

from .safetensors_io import Scratch, SafetensorsFile, SafetensorsFormatError, TensorInfo


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


def _open_file(fn: str, name: Optional[str] = None) -> SafetensorsFile:
    """Open and validate a file's header (``name``: the tensor it was opened for)."""
    try:
        return SafetensorsFile(fn)
    except SafetensorsFormatError as e:
        what = f"tensor {name!r} in {fn}: " if name is not None else ""
        raise CorruptCheckpointError(f"{what}cannot read safetensors header: {e}") from e


def checkpoint_files(path: str) -> tuple[dict[str, str], dict[str, SafetensorsFile]]:
    """(tensor name -> file, from the index when there is one, else from every *.safetensors;
    the files already opened)."""
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
        self.scratch, self.staged = Scratch(pin), Scratch(pin)  # staged: device targets only

    def _info(self, name: str) -> tuple[SafetensorsFile, TensorInfo]:
        fn = self.where[name]
        if fn not in self.files:
            self.files[fn] = _open_file(fn, name)
        f = self.files[fn]
        try:
            return f, f.info(name)
        except SafetensorsFormatError as e:  # the message names tensor and file
            raise CorruptCheckpointError(str(e)) from e

    def shape(self, name: str) -> tuple:
        return self._info(name)[1].shape

    def read(self, name: str, dst: torch.Tensor, rows: Optional[tuple[int, int]] = None,
             narrow: Optional[tuple[int, int, int]] = None) -> None:
        """dst <- the tensor, or rows [r0, r1) of its dim 0, then optionally ``.narrow(*narrow)``
        (a column slice needs the whole tensor read first)."""
        f, t = self._info(name)
        shape = list(t.shape) if rows is None else [rows[1] - rows[0]] + list(t.shape[1:])
        want = list(shape)
        if narrow is not None:
            want[narrow[0]] = narrow[2]
        if want != list(dst.shape):
            raise ShapeMismatchError(f"tensor {name!r} in {f.path}: shape {list(t.shape)} does "
                                     f"not fit parameter of shape {list(dst.shape)}")
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
