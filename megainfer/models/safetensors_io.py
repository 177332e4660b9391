"""A small safetensors reader that reads tensor bytes with plain file reads, never mmap.

Format: 8-byte little-endian header length ``n``, ``n`` bytes of JSON (``{name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then the byte buffer.
A tensor (or a range of its dim-0 rows) is read with ``readinto`` straight into the caller's
host buffer: the parameter's own storage when it is on the host in the checkpoint's dtype, else
a reusable ``Scratch``. Not ``safetensors.safe_open``: its mmap puts every touched page in the
process's resident set on top of the model. Every failure raises ``SafetensorsFormatError``
naming the file (and tensor); the loader turns it into ``CorruptCheckpointError``.
docs/gpu.md, "Loading without a host copy"."""
from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Optional

import torch

# safetensors dtype tag -> torch dtype. F32/F16/BF16 are what models use; the others load
# harmlessly (they are read and converted like any other tensor). F8_*: the weights of fp8
# block-quantised checkpoints, read as raw float8 and dequantised by the reader (``fp8.py``).
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit on the JSON header
_CHUNK = 1 << 30  # one read() call moves at most this many bytes (Linux caps near 2 GiB)


class SafetensorsFormatError(ValueError):
    """The file is not a valid safetensors file (or is truncated); the message names it."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple
    begin: int  # absolute byte offset in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of dim 0 (the whole tensor for a 0-d tensor)."""
        inner = math.prod(self.shape[1:]) if self.shape else 1
        return inner * self.dtype.itemsize


class SafetensorsFile:
    """One open safetensors file: its validated header, and reads of tensor bytes."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._f = open(path, "rb", buffering=0)
        except OSError as e:
            raise SafetensorsFormatError(f"{path}: cannot open ({e})") from e
        try:
            self.tensors = self._read_header()
        except BaseException:
            self._f.close()
            raise

    # ------------------------------------------------------------------ header
    def _read_header(self) -> dict[str, TensorInfo]:
        path, size = self.path, os.fstat(self._f.fileno()).st_size
        if size < 8:
            raise SafetensorsFormatError(f"{path}: {size} bytes, too short for a safetensors "
                                         "header (truncated?)")
        (n,) = struct.unpack("<Q", self._read_exact(0, 8))
        if n > MAX_HEADER or 8 + n > size:
            raise SafetensorsFormatError(f"{path}: header length {n} does not fit the file of "
                                         f"{size} bytes (truncated or not safetensors)")
        try:
            header = json.loads(self._read_exact(8, n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsFormatError(f"{path}: header is not JSON ({e})") from e
        if not isinstance(header, dict):
            raise SafetensorsFormatError(f"{path}: header is not a JSON object")
        start, buf = 8 + n, size - 8 - n
        out = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            out[name] = self._entry(name, meta, start, buf)
        return out

    def _entry(self, name: str, meta, start: int, buf: int) -> TensorInfo:
        where = f"tensor {name!r} in {self.path}"
        if not isinstance(meta, dict):
            raise SafetensorsFormatError(f"{where}: header entry is not an object")
        tag = meta.get("dtype")
        if tag not in DTYPES:
            raise SafetensorsFormatError(f"{where}: unknown dtype {tag!r} "
                                         f"(known: {', '.join(DTYPES)})")
        shape, offs = meta.get("shape"), meta.get("data_offsets")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                           for d in shape)):
            raise SafetensorsFormatError(f"{where}: bad shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise SafetensorsFormatError(f"{where}: bad data_offsets {offs!r}")
        b, e = offs
        dtype = DTYPES[tag]
        want = math.prod(shape) * dtype.itemsize
        if not 0 <= b <= e:
            raise SafetensorsFormatError(f"{where}: data_offsets {offs} are not a byte range")
        if e - b != want:
            raise SafetensorsFormatError(f"{where}: data_offsets {offs} hold {e - b} bytes, "
                                         f"{tag}{shape} needs {want}")
        if e > buf:
            raise SafetensorsFormatError(f"{where}: data_offsets {offs} run past the end of the "
                                         f"{buf}-byte data buffer (file truncated?)")
        return TensorInfo(name, dtype, tuple(shape), start + b, e - b)

    # ------------------------------------------------------------------ reads
    def keys(self):
        return self.tensors.keys()

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise SafetensorsFormatError(f"tensor {name!r} not in {self.path}") from None

    def read_into(self, name: str, out: torch.Tensor, rows: Optional[tuple[int, int]] = None
                  ) -> torch.Tensor:
        """Read the tensor's bytes, or rows [r0, r1) of its dim 0, into ``out`` (a contiguous
        host tensor with at least that many bytes; its dtype does not matter). Returns a view of
        ``out``'s first bytes as the tensor (dtype and shape of the checkpoint slice)."""
        t = self.info(name)
        if rows is None:
            first, shape = 0, t.shape
        else:
            r0, r1 = rows
            if not t.shape or not 0 <= r0 <= r1 <= t.shape[0]:
                raise SafetensorsFormatError(f"tensor {name!r} in {self.path}: rows {rows} "
                                             f"outside shape {list(t.shape)}")
            first, shape = r0, (r1 - r0,) + t.shape[1:]
        nbytes = math.prod(shape) * t.dtype.itemsize
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("read_into: out must be a contiguous host tensor")
        have = out.numel() * out.element_size()
        if have < nbytes:
            raise ValueError(f"read_into: out holds {have} bytes, tensor {name!r} needs {nbytes}")
        if nbytes:
            view = (ctypes.c_char * nbytes).from_address(out.data_ptr())
            try:
                self._readinto(t.begin + first * t.row_bytes, memoryview(view).cast("B"))
            except SafetensorsFormatError as e:
                raise SafetensorsFormatError(f"tensor {name!r} in {self.path}: {e}") from None
        flat = out.view(-1) if out.dim() else out.view(1)
        return flat.view(torch.uint8)[:nbytes].view(t.dtype).view(shape)

    def _read_exact(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self._readinto(offset, memoryview(buf))
        return bytes(buf)

    def _readinto(self, offset: int, mv: memoryview) -> None:
        self._f.seek(offset)
        done, n = 0, len(mv)
        while done < n:
            got = self._f.readinto(mv[done:min(n, done + _CHUNK)])
            if not got:
                raise SafetensorsFormatError(f"file ends {n - done} bytes early (truncated?)")
            done += got

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Scratch:
    """A reusable host byte buffer, grown to the largest request; pinned for a CUDA target so
    host-to-device copies go by DMA. Reads land here when they cannot go straight into a
    parameter (dtype conversion, a non-host parameter, a column slice)."""

    def __init__(self, pin: bool = False):
        self.pin, self.buf = pin, torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return self.buf

    def release(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)
