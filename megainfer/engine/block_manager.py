"""Paged KV cache bookkeeping: fixed-size blocks, a free list, reference counts.

The manager never touches tensors; it hands out physical block ids that index the
``[2, num_blocks, block_size, kv_heads, head_dim]`` cache of every layer. Blocks are taken
from the front of the free list and returned to its back, so the same sequence of calls gives
the same block ids on every rank (TP ranks of one replica must agree).

Forks (``SamplingParams.n``): a forked sequence shares its parent's blocks (``fork``). The
first write into a shared block (the prompt's partially filled last block) copies it first:
``allocate`` gives the writer a fresh block and records ``(src, dst)`` in ``pending_copies``,
which the engine applies to the KV tensors before the step runs (``take_copies``).
"""
from __future__ import annotations

from collections import deque

from .request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), in order

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req.block_table`` to hold ``num_tokens`` tokens. False (and no change) if the
        free list is too short."""
        table = req.block_table
        extra = self.blocks_needed(num_tokens) - len(table)
        first = req.num_computed_tokens // self.block_size  # the first block written
        cow = (num_tokens > req.num_computed_tokens and first < len(table)
               and self.ref_counts[table[first]] > 1)
        if extra <= 0 and not cow:
            return True
        if max(extra, 0) + cow > len(self.free):
            return False
        if cow:
            src, dst = table[first], self.free.popleft()
            self.ref_counts[dst] = 1
            self.ref_counts[src] -= 1
            table[first] = dst
            self.pending_copies.append((src, dst))
        for _ in range(extra):
            b = self.free.popleft()
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

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def free_request(self, req: Request) -> None:
        """Drop the request's references; blocks that reach zero return to the free list."""
        for b in req.block_table:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free.append(b)
            elif self.ref_counts[b] < 0:
                raise RuntimeError(f"block {b}: freed more often than allocated")
        req.block_table = []
