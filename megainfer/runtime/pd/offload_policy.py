"""Rank 0's choice of the requests whose decode attention runs on their prefill rank
(``pd.offload``).

At hand-out, a request with one sample and no prompt logprobs is offloaded when the fixed
fraction ``pd.offload_ratio`` says so (the k-th such request when ``floor((k + 1) r) > floor(k
r)``) and its prefill rank's pool has room for its whole life, ``min(prompt + max_tokens,
max_model_len)`` tokens, reserved up front. Rank 0 keeps the ledger: the room comes back when
the request's output reaches rank 0 or it is dropped at the prefill rank.
docs/pd.md, "Decode attention offloaded to the prefill ranks".
"""
from __future__ import annotations

import math
from typing import Optional


class OffloadLedger:
    def __init__(self, ratio: float, pool_blocks: int, num_prefill: int, block_size: int,
                 max_model_len: int):
        self.ratio, self.block_size, self.max_model_len = ratio, block_size, max_model_len
        self.pool_blocks = pool_blocks
        self.free = [pool_blocks] * num_prefill  # per prefill rank: pool blocks not promised
        self.held: dict[int, tuple[int, int]] = {}  # xfer -> (prefill index, blocks)
        self.xfer_of: dict[str, int] = {}  # request id -> xfer, once it decodes
        self.eligible = 0  # requests that could have been offloaded
        self.offloaded = 0  # requests offloaded
        self.no_room = 0  # chosen by the ratio but the pool was full

    def decide(self, p: int, xfer: int, inp, num_prompt_tokens: int) -> int:
        """Tokens prefill rank ``p`` keeps room for (0: the request's KV is streamed)."""
        params = inp.params
        if params.n != 1 or params.prompt_logprobs is not None:
            return 0
        k = self.eligible
        self.eligible += 1
        if math.floor((k + 1) * self.ratio) <= math.floor(k * self.ratio):
            return 0
        mml = self.max_model_len
        tokens = min(num_prompt_tokens + (params.max_tokens or mml), mml)
        need = -(-tokens // self.block_size)
        if need > self.free[p]:
            self.no_room += 1
            return 0
        self.free[p] -= need
        self.held[xfer] = (p, need)
        self.offloaded += 1
        return tokens

    def is_offloaded(self, xfer: int) -> bool:
        return xfer in self.held

    def decoding(self, request_id: str, xfer: int) -> None:
        if xfer in self.held:
            self.xfer_of[request_id] = xfer

    def credit(self, xfer: Optional[int]) -> None:
        held = self.held.pop(xfer, None) if xfer is not None else None
        if held is not None:
            self.free[held[0]] += held[1]

    def finished(self, request_id: str) -> None:
        self.credit(self.xfer_of.pop(request_id, None))
