"""Paged KV cache bookkeeping: fixed-size blocks, a free list, reference counts, forks with
copy-on-write, and the prefix cache. It never touches tensors: it hands out block ids.

Invariants:
* Deterministic (blocks leave the free list's front, return to its back; every structure
  ordered): the same calls give the same ids, hits and evictions on every rank.
* A shared block is copied before it is written (``pending_copies``, applied by the engine
  before the step); full blocks are never written again.
* A prefix hit needs the chained blake2b key, the token ids and the parent's content id to
  match, block by block from the first; a request's last token is never a hit.
* A freed cached block keeps its key in an LRU list; with a second tier (``kv_tier``) an
  evicted block is saved there first. docs/engine.md, "Prefix caching"; docs/kv_cache.md."""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from typing import Callable, Optional, Sequence

from .request import Request


def hash_block_tokens(parent: Optional[int], tokens: Sequence[int]) -> int:
    """The key of a full block: 64-bit blake2b of the parent's key and the int64 token ids.
    Deterministic across processes (unlike ``hash`` of bytes / str)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((0 if parent is None else parent + 1).to_bytes(9, "little", signed=False))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")


def chain_block_keys(keys: list[int], block_tokens: Callable[[int], Sequence[int]],
                     n: int) -> list[int]:
    """Extend ``keys`` (the chained keys of the first ``len(keys)`` full blocks) to ``n`` keys;
    ``block_tokens(i)`` gives block i's token ids. The one definition of a prefix's keys, shared
    by the block manager and rank 0's router."""
    while len(keys) < n:
        keys.append(hash_block_tokens(keys[-1] if keys else None, block_tokens(len(keys))))
    return keys


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 tier=None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tier = tier  # the second tier (KVTier) or None
        self.free: deque[int] = deque(range(num_blocks))  # holding nothing reusable
        self.ref_counts = [0] * num_blocks
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), in order
        # prefix cache: key -> block, per-block (key, tokens, content id, parent's content id)
        self.cached: dict[int, int] = {}
        self.block_key: list[Optional[int]] = [None] * num_blocks
        self.block_tokens: list[Optional[tuple]] = [None] * num_blocks
        self.block_uid: list[int] = [0] * num_blocks  # 0: not cached; content ids start at 1
        self.block_parent_uid: list[int] = [0] * num_blocks  # 0: the first block of a sequence
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0, LRU first
        self._next_uid = 1
        self.num_evictions = 0
        self.key_events: Optional[list] = None  # (key, +1 / -1) once ``track_keys`` is called

    def track_keys(self) -> None:
        """Record the keys this cache (and its tier) gains and loses, for a router."""
        self.key_events = []
        if self.tier is not None:
            self.tier.key_events = []

    def take_key_events(self) -> list[tuple[int, int]]:
        """The (key, +1 gained / -1 lost) events since the last call, first tier then tier."""
        out = self.key_events or []
        if self.key_events is not None:
            self.key_events = []
        if self.tier is not None and self.tier.key_events:
            out, self.tier.key_events = out + self.tier.key_events, []
        return out

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def _keys(self, req: Request, n: int) -> list[int]:
        """The keys of the request's first ``n`` full blocks (content only: memoized)."""
        bs = self.block_size
        return chain_block_keys(req.block_hashes, lambda i: req.token_slice(i * bs, (i + 1) * bs), n)

    def find_cached(self, req: Request, max_tokens: Optional[int] = None) -> list:
        """The longest run of cached blocks holding the request's first full blocks (tokens and
        parent chain checked), leaving at least its last token (and anything at or beyond
        ``max_tokens``) to compute: first-tier block ids, or second-tier ``TierEntry``s where
        the first tier misses. Changes nothing (but drops a corrupt tier entry it meets)."""
        if not self.enable_prefix_caching:
            return []
        limit = req.num_tokens - 1 if max_tokens is None else min(req.num_tokens - 1, max_tokens)
        n = max(limit, 0) // self.block_size
        if n == 0:
            return []
        bs, hits, parent = self.block_size, [], 0
        for i, key in enumerate(self._keys(req, n)):
            b, tokens = self.cached.get(key), tuple(req.token_slice(i * bs, (i + 1) * bs))
            if b is None or self.block_parent_uid[b] != parent or self.block_tokens[b] != tokens:
                e = self.tier.lookup(key, tokens, parent) if self.tier is not None else None
                if e is None:
                    break
                hits.append(e)
                parent = e.uid
                continue
            hits.append(b)
            parent = self.block_uid[b]
        return hits

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's computed full blocks not registered yet (call after the step
        that computed them). A block whose content is cached already (another block) stays
        uncached; a collision with other content ends the chain for this request."""
        if not self.enable_prefix_caching:
            return
        bs, uids, table = self.block_size, req.block_uids, req.block_table
        full = min(req.num_computed_tokens // bs, len(table))
        if len(uids) >= full or (uids and uids[-1] == 0):
            return
        keys = self._keys(req, full)
        for i in range(len(uids), full):
            b, parent = table[i], (uids[i - 1] if i else 0)
            if self.block_uid[b]:  # a cache hit or a fork of one: cached already
                uids.append(self.block_uid[b])
                continue
            tokens = tuple(req.token_slice(i * bs, (i + 1) * bs))
            other = self.cached.get(keys[i])
            if other is not None:
                same = self.block_tokens[other] == tokens and \
                    self.block_parent_uid[other] == parent
                uids.append(self.block_uid[other] if same else 0)
                if not same:  # a collision: the key is taken by other content
                    return
                continue
            uid = self.tier.uid_for(keys[i], tokens, parent) if self.tier is not None else None
            if uid is None:  # new content (else: the same content as a tier entry, its id)
                uid, self._next_uid = self._next_uid, self._next_uid + 1
            self._register(b, keys[i], tokens, uid, parent)
            uids.append(uid)

    def _register(self, b: int, key: int, tokens: tuple, uid: int, parent: int) -> None:
        if key not in self.cached:
            self.cached[key] = b
            if self.key_events is not None:
                self.key_events.append((key, 1))
        self.block_key[b], self.block_tokens[b] = key, tokens
        self.block_uid[b], self.block_parent_uid[b] = uid, parent

    def _uncache(self, b: int) -> None:
        key = self.block_key[b]
        if key is not None and self.cached.get(key) == b:
            del self.cached[key]
            if self.key_events is not None:
                self.key_events.append((key, -1))
        self.block_key[b] = self.block_tokens[b] = None
        self.block_uid[b] = self.block_parent_uid[b] = 0

    def _take(self) -> int:
        """A block for new contents: a free one holding nothing, else evict the LRU cached one."""
        if self.free:
            return self.free.popleft()
        b, _ = self.evictable.popitem(last=False)
        if self.tier is not None:  # down to the second tier (contents intact until the step)
            self.tier.save(b, self.block_key[b], self.block_uid[b], self.block_parent_uid[b],
                           self.block_tokens[b])
        self._uncache(b)
        self.num_evictions += 1
        return b

    # ------------------------------------------------------------------ allocation
    def allocate(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Grow ``req.block_table`` to hold ``num_tokens`` tokens. ``cached``: blocks from
        ``find_cached`` for a request without blocks; they start its table (and its
        ``num_computed_tokens``); a ``TierEntry`` among them gets a fresh block its bytes are
        copied back into. False (and no change) if the free blocks are too few."""
        table = req.block_table
        if cached:
            if table or req.num_computed_tokens:
                raise ValueError(f"request {req.request_id!r}: cache hits for a started request")
            first = [b for b in cached if isinstance(b, int)]
            reserved = sum(1 for b in first if self.ref_counts[b] == 0) + len(cached) - len(first)
            extra = self.blocks_needed(num_tokens) - len(cached)
            if max(extra, 0) + reserved > self.num_free_blocks:
                return False
            for b in first:  # pinned first: taking fresh blocks below must not evict them
                if self.ref_counts[b] == 0:
                    del self.evictable[b]
                self.ref_counts[b] += 1
            for b in cached:
                if not isinstance(b, int):  # a second-tier hit: a fresh block, copied back
                    e, b = b, self._take()
                    self.ref_counts[b] = 1
                    self._register(b, e.key, e.tokens, e.uid, e.parent_uid)
                    self.tier.load(e, b)
                table.append(b)
            req.num_computed_tokens = len(cached) * self.block_size
            req.block_uids = [self.block_uid[b] for b in table]
            for _ in range(extra):
                b = self._take()
                self.ref_counts[b] = 1
                table.append(b)
            return True
        extra = self.blocks_needed(num_tokens) - len(table)
        first = req.num_computed_tokens // self.block_size  # the first block written
        cow = (num_tokens > req.num_computed_tokens and first < len(table)
               and self.ref_counts[table[first]] > 1)
        if extra <= 0 and not cow:
            return True
        if max(extra, 0) + cow > self.num_free_blocks:
            return False
        if cow:
            src = table[first]
            if self.block_uid[src]:  # full cached blocks are never written
                raise RuntimeError(f"block {src}: write into a cached full block")
            dst = self._take()
            self.ref_counts[dst] = 1
            self.ref_counts[src] -= 1
            table[first] = dst
            self.pending_copies.append((src, dst))
        for _ in range(extra):
            b = self._take()
            self.ref_counts[b] = 1
            req.block_table.append(b)
        return True

    def share(self, block: int) -> int:
        """Another holder of ``block`` (prefix sharing / forks): bump its reference count."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block}: cannot share a free block")
        self.ref_counts[block] += 1
        return block

    def fork(self, parent: Request, child: Request) -> None:
        """``child`` shares every block of ``parent`` (written blocks are copied on write)."""
        child.block_table = [self.share(b) for b in parent.block_table]
        child.block_hashes = list(parent.block_hashes)
        child.block_uids = list(parent.block_uids)

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def free_request(self, req: Request) -> None:
        """Drop the request's references. Blocks that reach zero return to the free list, or,
        cached ones, to the back of the LRU list, last block first (a prefix outlives its
        continuations)."""
        released = []
        for b in req.block_table:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_uid[b]:
                    released.append(b)
                else:
                    self.free.append(b)
            elif self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b}: freed more often than allocated")
        for b in reversed(released):
            self.evictable[b] = None
        req.block_table = []
