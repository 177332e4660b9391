"""The prefix cache's second tier: cached KV blocks evicted from the engine's paged KV tensors are
kept here, bounded by ``cache.host_kv_gib`` and least-recently-used, and copied back on a hit.

* ``HostStore`` (cuda): one pinned host buffer; a block comes back layer by layer on a side
  stream, each layer's forward waiting on its own copy's event (``attach``).
* ``FileStore`` (cpu): one safetensors file per block under ``cache.kv_store_dir`` (a temporary
  directory when unset), read with plain reads, never mmap or pickle.

Invariants: a block is stored as raw bytes of every layer, whatever the cache format; an entry
keeps the first tier's identity (key, tokens, content ids) and a blake2b checksum; ``lookup``
serves it only when all match (else dropped and recomputed), and ``apply_loads`` copies the
bytes it verified. docs/kv_cache.md, "Prefix caching: the second tier (`cache.host_kv_gib`)"."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
import safetensors.torch

from megainfer.config import ConfigError

log = logging.getLogger("megainfer.engine")


@dataclass
class TierEntry:
    key: int
    uid: int
    parent_uid: int
    tokens: tuple
    slot: int  # HostStore slot / FileStore file number
    checksum: bytes


def checksum(data: torch.Tensor) -> bytes:
    """blake2b-128 of a host uint8 tensor's bytes."""
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=16).digest()


class HostStore:
    """``capacity`` slots of ``nbytes`` in one (pinned on cuda) host buffer."""

    def __init__(self, capacity: int, nbytes: int, pin: bool):
        self.buf = torch.empty((capacity, nbytes), dtype=torch.uint8, pin_memory=pin)

    def write(self, slot: int, data: torch.Tensor) -> None:
        self.buf[slot].copy_(data)

    def read(self, slot: int) -> Optional[torch.Tensor]:
        return self.buf[slot]

    def drop(self, slot: int) -> None:
        pass


class FileStore:
    """One safetensors file per block in a fresh directory under ``root``."""

    def __init__(self, root: Optional[str], nbytes: int, name: str):
        if root:
            os.makedirs(root, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix=f"kv_{name}_", dir=root or None)
        self.nbytes = nbytes
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)

    def path(self, slot: int) -> str:
        return os.path.join(self.dir, f"block_{slot}.safetensors")

    def write(self, slot: int, data: torch.Tensor) -> None:
        with open(self.path(slot), "wb") as f:
            f.write(safetensors.torch.save({"kv": data.contiguous()}))

    def read(self, slot: int) -> Optional[torch.Tensor]:
        """The stored bytes, or None when the file is missing, truncated or unreadable."""
        try:
            with open(self.path(slot), "rb") as f:
                t = safetensors.torch.load(f.read())["kv"]
        except Exception:  # safetensors raises its own errors on a truncated header/buffer
            return None
        return t if t.dtype == torch.uint8 and t.numel() == self.nbytes else None

    def drop(self, slot: int) -> None:
        try:
            os.remove(self.path(slot))
        except FileNotFoundError:
            pass


class KVTier:
    """The second tier over one rank's per-layer KV cache tensors (``block_dim``: the
    spec's ``block_axis``)."""

    def __init__(self, kv_caches: list[torch.Tensor], block_dim: int, capacity: int,
                 store_dir: Optional[str] = None, name: str = "rank", log_prefix: str = ""):
        self.kv, self.dim, self.capacity = kv_caches, block_dim, capacity
        self.log_prefix = log_prefix
        one = [kv.select(block_dim, 0) for kv in kv_caches]
        self.layer_bytes = [t.numel() * t.element_size() for t in one]
        self.offsets = [sum(self.layer_bytes[:i]) for i in range(len(one) + 1)]
        self.nbytes = self.offsets[-1]
        self.cuda = bool(kv_caches) and kv_caches[0].is_cuda
        self.store = HostStore(capacity, self.nbytes, True) if self.cuda else \
            FileStore(store_dir, self.nbytes, name)
        self.index: dict[int, TierEntry] = {}  # key -> entry
        self.lru: OrderedDict[int, None] = OrderedDict()  # keys, least recently used first
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.staged: dict[int, torch.Tensor] = {}  # key -> verified bytes (lookup -> load)
        self.pending: list[tuple[int, int]] = []  # (key, first-tier block) to copy back
        self.stream = torch.cuda.Stream(kv_caches[0].device) if self.cuda else None
        self.events: list = []  # cuda: per-layer copy events of the step in flight
        self.key_events: Optional[list] = None  # (key, +1 / -1) for a router (track_keys)
        self.attached = False  # cuda: layers wait on their own event (else all, up front)
        self.num_saved = self.num_loaded = self.num_corrupt = self.num_dropped = 0

    def __len__(self) -> int:
        return len(self.index)

    # ------------------------------------------------------------------ down (eviction)
    def save(self, block: int, key: int, uid: int, parent_uid: int, tokens: tuple) -> None:
        """Keep a first-tier block being evicted (its contents are intact until the step)."""
        e = self.index.get(key)
        if e is not None:  # already here (it came from here, or a same-key content: first wins)
            self.lru.move_to_end(key)
            return
        if not self.free_slots and not self._evict_one():
            return  # every entry is being loaded this step: nothing to give up
        data = torch.cat([kv.select(self.dim, block).contiguous().view(torch.uint8).reshape(-1)
                          for kv in self.kv]).cpu()
        slot = self.free_slots.pop()
        self.store.write(slot, data)
        self.index[key] = TierEntry(key, uid, parent_uid, tuple(tokens), slot, checksum(data))
        self.lru[key] = None
        self.num_saved += 1
        if self.key_events is not None:
            self.key_events.append((key, 1))

    def _evict_one(self) -> bool:
        busy = {k for k, _ in self.pending} | set(self.staged)  # this step's hits stay
        for key in self.lru:
            if key not in busy:
                self._drop(key)
                self.num_dropped += 1
                return True
        return False

    def _drop(self, key: int) -> None:
        e = self.index.pop(key)
        del self.lru[key]
        if self.key_events is not None:
            self.key_events.append((key, -1))
        self.staged.pop(key, None)
        self.store.drop(e.slot)
        self.free_slots.append(e.slot)

    # ------------------------------------------------------------------ up (hits)
    def uid_for(self, key: int, tokens: tuple, parent_uid: int) -> Optional[int]:
        """The content id of a stored block with these tokens and parent (no byte check)."""
        e = self.index.get(key)
        return e.uid if e is not None and e.tokens == tokens and e.parent_uid == parent_uid \
            else None

    def lookup(self, key: int, tokens: tuple, parent_uid: int) -> Optional[TierEntry]:
        """The entry for this block if its tokens and parent match and its bytes check out
        (they are staged for ``apply_loads``); a corrupt entry is dropped: None."""
        e = self.index.get(key)
        if e is None or e.tokens != tokens or e.parent_uid != parent_uid:
            return None
        data = self.staged.get(key)
        if data is None:
            data = self.store.read(e.slot)
            if data is None or checksum(data) != e.checksum:
                log.warning("%s KV tier: stored block %016x (slot %d) is corrupt or truncated; "
                            "dropped, it will be recomputed", self.log_prefix, key, e.slot)
                self.num_corrupt += 1
                self._drop(key)
                return None
            self.staged[key] = data
        self.lru.move_to_end(key)
        return e

    def load(self, entry: TierEntry, block: int) -> None:
        """Copy a looked-up entry into first-tier ``block`` before the next step runs."""
        self.pending.append((entry.key, block))

    def apply_loads(self) -> None:
        """Copy the pending blocks back, layer by layer (cuda: on the side stream, an event per
        layer that ``wait_layer`` makes the layer's forward wait on). Clears the staging."""
        loads = [(self.staged[k], b) for k, b in self.pending]
        self.pending, self.staged, self.events = [], {}, []
        if not loads:
            return
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        for l, kv in enumerate(self.kv):
            a, z = self.offsets[l], self.offsets[l + 1]
            with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
                for data, b in loads:
                    dst = kv.select(self.dim, b)
                    dst.copy_(data[a:z].view(kv.dtype).view(dst.shape), non_blocking=self.cuda)
                if self.cuda:
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    self.events.append(ev)
        self.num_loaded += len(loads)
        if self.cuda and not self.attached:
            self.wait_all()

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait for layer ``layer``'s copies (no-op on cpu / none)."""
        if layer < len(self.events):
            torch.cuda.current_stream(self.stream.device).wait_event(self.events[layer])

    def wait_all(self) -> None:
        for l in range(len(self.events)):
            self.wait_layer(l)

    def attach(self, layers) -> bool:
        """cuda: each layer's forward waits for its own blocks (a pre-hook); False if not."""
        if not self.cuda or layers is None:
            return False
        for l, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda mod, args, l=l: self.wait_layer(l))
        self.attached = True
        return True


def make_kv_tier(cache_config, kv_spec, kv_caches, log_prefix: str = "") -> Optional[KVTier]:
    """The second tier of ``cache.host_kv_gib`` (None when 0 or prefix caching is off)."""
    gib = cache_config.host_kv_gib
    if not gib or not cache_config.enable_prefix_caching or not kv_caches:
        return None
    dim = kv_spec.block_axis
    per_block = sum(kv.select(dim, 0).numel() * kv.element_size() for kv in kv_caches)
    capacity = int(gib * 2 ** 30) // per_block
    if capacity < 1:
        raise ConfigError(f"cache.host_kv_gib={gib}: smaller than one KV block "
                          f"({per_block} bytes on this rank); raise it or set 0 (off)")
    name = "".join(ch if ch.isalnum() else "_" for ch in log_prefix.strip("[]")) or "rank"
    log.info("%s KV tier: %d blocks (%.3f GiB) in %s", log_prefix, capacity, gib,
             "pinned host memory" if kv_caches[0].is_cuda else "files")
    return KVTier(kv_caches, dim, capacity, cache_config.kv_store_dir, name, log_prefix)
