"""What one prefill-decode KV transfer is made of (docs/pd.md): its segments (a run of blocks,
about one prefill chunk), the MPI tag of each (transfer, layer, segment), the block-major
bytes a layer's segment gathers from the paged cache, and the receive buffer they land in.
``kv_stream`` moves them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megainfer.models.kv_spec import BLOCK_AXIS

TAG_BASE = 1000


@dataclass(frozen=True)
class Segments:
    """How a transfer is cut: ``blocks`` blocks per segment; ``max_count`` segments at most
    (a prompt of ``max_model_len``), which spaces the tags."""

    blocks: int
    max_count: int

    @classmethod
    def for_job(cls, max_model_len: int, block_size: int, max_num_batched_tokens: int):
        per = max(1, max_num_batched_tokens // block_size)
        return cls(per, -(-(-(-max_model_len // block_size)) // per))

    def count(self, num_blocks: int) -> int:
        return -(-num_blocks // self.blocks)

    def span(self, j: int, num_blocks: int) -> tuple[int, int]:
        return j * self.blocks, min((j + 1) * self.blocks, num_blocks)


def kv_tag(xfer: int, layer: int, seg: int, num_layers: int, segs: Segments, tag_ub: int) -> int:
    """The MPI tag of (transfer, layer, segment): distinct for every transfer in flight."""
    return TAG_BASE + ((xfer * num_layers + layer) * segs.max_count + seg) % (tag_ub - TAG_BASE)


def host_bytes(t: torch.Tensor):
    """A contiguous host tensor as a uint8 numpy view (any storage dtype, bf16 and fp8 too)."""
    t = t.contiguous()
    if t.is_cuda:
        t = t.cpu()
    return t.view(-1).view(torch.uint8).numpy()


def gather_blocks(kv: torch.Tensor, kind: str, blocks: list[int], num_tokens: int) -> torch.Tensor:
    """One layer's cache -> the request's blocks, contiguous, positions >= num_tokens zeroed.
    GQA [2, NB, BS, H, D] -> [2, n, BS, H, D]; MLA [NB, BS, R] -> [n, BS, R] (a destination's
    heads are sliced by the sender)."""
    idx = torch.tensor(blocks, dtype=torch.long, device=kv.device)
    if kv.element_size() == 1:  # float8 / packed fp4: gather and zero as bytes
        kv = kv.view(torch.uint8)
    g = kv.index_select(BLOCK_AXIS[kind], idx).contiguous()
    if kind == "gqa":
        g.view(2, -1, *g.shape[3:])[:, num_tokens:] = 0
    else:
        g.view(-1, g.shape[-1])[num_tokens:] = 0
    return g


def staging_shape(kind: str, layer_shape: tuple, num_blocks: int,
                  heads: Optional[int] = None) -> tuple:
    """The receive buffer of one layer from one sender, block-major (a segment is a contiguous
    slice): GQA ``[n, 2, BS, h, D]`` (``heads``: h, else the cache's), MLA ``[n, BS, R]``."""
    if kind == "gqa":
        h = layer_shape[3] if heads is None else heads
        return (num_blocks, layer_shape[0], layer_shape[2], h, *layer_shape[4:])
    return (num_blocks, *layer_shape[1:])
