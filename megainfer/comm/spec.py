"""What one message looks like in bytes: a 32-byte header, then row-aligned typed fields.

A message of ``n`` rows is packed *compactly*: header, then field 0 as ``[n, *shape]``, then
field 1, ... each starting on a 16-byte boundary. Its size ``nbytes(n)`` grows with ``n``, so
the MPI transport moves only the used bytes; one buffer of ``nbytes(capacity)`` holds any
message, so each message is one send.

Header (int32 x 8): magic, kind, rows, iteration, layer, micro_batch, src rank, aux. The
magic word is "M2" plus a 16-bit fingerprint of the spec (field names, shapes, dtypes,
capacity): a receiver built with another spec than its sender rejects the message.
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import torch

from megainfer.config import ConfigError

HEADER_BYTES = 32
ALIGN = 16
MAGIC_HI = 0x4D320000  # "M2" in the magic word's high half; the low half is the spec's

HEADER = struct.Struct("<8i")  # pack_into / unpack_from the header, no numpy round trip
# header slots (int32 index)
H_MAGIC, H_KIND, H_ROWS, H_ITER, H_LAYER, H_MB, H_SRC, H_AUX = range(8)

# kinds: DATA carries tokens; the rest are control messages on the same channel
KIND_DATA, KIND_STOP, KIND_REBALANCE = 0, 1, 2
KIND_NAMES = {KIND_DATA: "data", KIND_STOP: "stop", KIND_REBALANCE: "rebalance"}


def _align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Field:
    """One row-aligned field: each row is a tensor of ``shape`` and ``dtype``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ConfigError(f"field.name={self.name!r}: must be an identifier")
        if not all(isinstance(s, int) and s > 0 for s in self.shape):
            raise ConfigError(f"field {self.name}.shape={self.shape!r}: must be positive ints")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"field {self.name}.dtype={self.dtype!r}: must be a torch.dtype")

    @property
    def row_elems(self) -> int:
        return math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.dtype.itemsize


@dataclass(frozen=True)
class MessageSpec:
    """Named fields plus the most rows one message may carry."""

    fields: tuple[Field, ...]
    capacity: int

    def __post_init__(self):
        if not (isinstance(self.capacity, int) and self.capacity >= 0):
            raise ConfigError(f"spec.capacity={self.capacity!r}: must be an int >= 0")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ConfigError(f"spec.fields={names}: duplicate field names")

    @staticmethod
    def of(capacity: int, **fields: tuple[tuple[int, ...], torch.dtype]) -> "MessageSpec":
        """``MessageSpec.of(64, hidden=((H,), torch.float32), ids=((k,), torch.int32))``."""
        return MessageSpec(tuple(Field(n, tuple(s), d) for n, (s, d) in fields.items()), capacity)

    def offsets(self, rows: int) -> list[int]:
        """Byte offset of each field in a message of ``rows`` rows."""
        out, pos = [], HEADER_BYTES
        for f in self.fields:
            out.append(pos)
            pos = _align(pos + rows * f.row_bytes)
        return out

    def nbytes(self, rows: int) -> int:
        """Bytes on the wire for a message of ``rows`` rows (header included)."""
        pos = HEADER_BYTES
        for f in self.fields:
            pos = _align(pos + rows * f.row_bytes)
        return pos

    @property
    def magic(self) -> int:
        """The header's magic word for this spec: "M2" + 16-bit fingerprint."""
        desc = repr([(f.name, f.shape, str(f.dtype)) for f in self.fields] + [self.capacity])
        return MAGIC_HI | (zlib.crc32(desc.encode()) & 0xFFFF)

    @property
    def max_nbytes(self) -> int:
        return self.nbytes(self.capacity)

    def check_rows(self, rows: int, where: str) -> None:
        if rows > self.capacity:
            from megainfer.comm.errors import MessageTooLargeError
            raise MessageTooLargeError(f"{where}: {rows} rows exceed the channel capacity of "
                                       f"{self.capacity} rows ({self.nbytes(rows)} > "
                                       f"{self.max_nbytes} bytes); raise capacity or split the batch")
        if rows < 0:
            raise ValueError(f"{where}: rows={rows} must be >= 0")


class MessageLayout:
    """Typed views of one buffer under a spec, cheap to slice per message (one op per field)."""

    def __init__(self, spec: MessageSpec, data: torch.Tensor):
        # data: [max_nbytes rounded up to ALIGN] uint8
        self.spec, self.data = spec, data
        flat = {}  # dtype -> whole buffer viewed as that dtype
        for f in spec.fields:
            if f.dtype not in flat:
                flat[f.dtype] = data.view(f.dtype)
        self._plan = [(f.name, flat[f.dtype], f.shape, _contiguous_strides(f.shape), f.row_elems,
                       f.dtype.itemsize) for f in spec.fields]

    def views(self, rows: int) -> dict[str, torch.Tensor]:
        """Field name -> view ``[rows, *shape]`` into the buffer (no copy)."""
        out, pos = {}, HEADER_BYTES
        for (name, flat, shape, inner, row_elems, itemsize) in self._plan:
            out[name] = flat.as_strided((rows,) + shape, (row_elems,) + inner, pos // itemsize)
            pos = (pos + rows * row_elems * itemsize + ALIGN - 1) // ALIGN * ALIGN
        return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def alloc_nbytes(spec: MessageSpec) -> int:
    """Buffer size for one slot: max message rounded up so every dtype view divides it."""
    return _align(spec.max_nbytes)
