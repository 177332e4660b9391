"""Decode steps of single mode replayed from CUDA graphs, one graph per padded batch size: at
small batches the host's kernel launches, not the GPU, set the pace; a graph replays the
whole forward with one launch. Static inputs, filled by one host-to-device copy:

    rows [B_max, 4 + W] int64: token id, position, KV slot (-1: padded row, writes nothing),
                               sequence length (0: padded row), block table (W block ids)

A step of S sequences runs the graph of the smallest captured B >= S (``max_query_len = 1``,
the Triton decode kernel); the first S rows of its static logits are returned, valid until the
next replay. Graphs are captured on first use of a size, after one eager warm-up run, and share
one memory pool. docs/gpu.md, "CUDA graphs for decode"."""
from __future__ import annotations

import logging

import numpy as np
import torch

from megainfer.models.attention import AttentionMetadata

log = logging.getLogger("megainfer.engine")


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    """Owns the static input rows, the captured graphs and their outputs."""

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_batch: int,
                 max_model_len: int):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.device = kv_caches[0].device
        self.W = -(-max_model_len // block_size)  # block-table width of every graph
        self.sizes = graph_batch_sizes(max_batch)
        self.rows = torch.zeros(self.sizes[-1], 4 + self.W, dtype=torch.long, device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def fits(self, query_lens: list[int], block_tables: list[list[int]]) -> bool:
        return (0 < len(query_lens) <= self.sizes[-1] and all(n == 1 for n in query_lens)
                and max(len(b) for b in block_tables) <= self.W)

    def run(self, ids: list[int], positions: list[int], block_tables: list[list[int]]
            ) -> torch.Tensor:
        """One decode step of S = len(ids) sequences -> logits [S, V] fp32 (a view)."""
        S = len(ids)
        B = next(b for b in self.sizes if b >= S)
        BS = self.block_size
        host = np.zeros((B, 4 + self.W), dtype=np.int64)  # numpy: cheap per-row fills
        host[:, 2] = -1
        pos = np.asarray(positions, dtype=np.int64)
        host[:S, 0], host[:S, 1], host[:S, 3] = ids, pos, pos + 1
        for i, bt in enumerate(block_tables):
            host[i, 4:4 + len(bt)] = bt
        host[:S, 2] = host[np.arange(S), 4 + pos // BS] * BS + pos % BS
        self.rows[:B].copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)
        if B not in self.graphs:
            self.graphs[B] = self._capture(B)
        graph, logits = self.graphs[B]
        graph.replay()
        return logits[:S]

    def _forward(self, B: int) -> torch.Tensor:
        rows = self.rows[:B]
        ids, pos = rows[:, 0].contiguous(), rows[:, 1].contiguous()  # [B], [B]
        seq_lens, tables = rows[:, 3].contiguous(), rows[:, 4:].contiguous()  # [B], [B, W]
        ar = torch.arange(B + 1, device=self.device)
        meta = AttentionMetadata(
            query_start_loc=ar, context_lens=seq_lens - 1, seq_lens=seq_lens, block_tables=tables,
            slot_mapping=rows[:, 2].contiguous(), block_size=self.block_size,
            query_lens_list=[1] * B, seq_lens_list=[0] * B, decode_seqs=ar[:B], decode_rows=ar[:B],
            query_starts_list=list(range(B + 1)), decode_seqs_list=list(range(B)), max_query_len=1)
        hidden = self.model(ids, pos, meta, self.kv_caches)  # [B, H]
        return self.model.compute_logits(hidden)  # [B, V] fp32

    def _capture(self, B: int):
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(B)  # warm-up: Triton compiles, the allocator settles
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(B)
        self.pool = graph.pool()
        log.info("captured a CUDA graph for decode batch %d", B)
        return graph, logits
