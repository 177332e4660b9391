"""Rank 0's choice of the requests whose decode attention runs on their prefill rank
(``pd.offload``).

At hand-out, a request with one sample and no prompt logprobs is offloaded by
``perfmodel/offload_rule.py``'s rule (the one the PD simulator applies): with
``pd.offload_policy=ratio`` when the fixed fraction ``pd.offload_ratio`` says so and its prefill
rank's pool has room for its whole life, ``min(prompt + max_tokens, max_model_len)`` tokens,
reserved up front; with ``auto`` when that pool has room and its decode replica's KV
(``cache.num_blocks`` blocks) would not hold it beside the local requests rank 0 has given that
replica (their whole lives). Rank 0 keeps the ledger: the room comes back when the request's
output reaches rank 0 or it is dropped at the prefill rank. The TPOT part of ``auto`` is not
wired here: rank 0 has no TPOT prediction (the simulator's book has one).
docs/pd.md, "Decode attention offloaded to the prefill ranks".
"""
from __future__ import annotations

from typing import Optional

from megainfer.perfmodel.offload_rule import (OffloadCandidate, blocks_for, picks_auto,
                                             picks_by_ratio)


class OffloadLedger:
    def __init__(self, ratio: float, pool_blocks: int, num_prefill: int, block_size: int,
                 max_model_len: int, policy: str = "ratio", num_decode: int = 1,
                 decode_kv_tokens: Optional[int] = None):
        self.ratio, self.block_size, self.max_model_len = ratio, block_size, max_model_len
        self.pool_blocks, self.auto = pool_blocks, policy == "auto"
        self.free = [pool_blocks] * num_prefill  # per prefill rank: pool blocks not promised
        self.held: dict[int, tuple[int, int]] = {}  # xfer -> (prefill index, blocks)
        self.kv_cap = decode_kv_tokens  # a decode replica's KV, tokens (None: unlimited)
        self.local = [0] * num_decode  # per decode replica: whole-life tokens of its local requests
        self.held_local: dict[int, tuple[int, int]] = {}  # local xfer -> (decode replica, tokens)
        self.xfer_of: dict[str, int] = {}  # request id -> xfer, once it decodes
        self.eligible = 0  # requests that could have been offloaded
        self.offloaded = 0  # requests offloaded
        self.no_room = 0  # chosen by the ratio but the pool was full

    def decide(self, p: int, d: int, xfer: int, inp, num_prompt_tokens: int) -> int:
        """Tokens prefill rank ``p`` keeps room for (0: the request's KV is streamed to decode
        replica ``d``)."""
        params = inp.params
        mml = self.max_model_len
        tokens = min(num_prompt_tokens + (params.max_tokens or mml), mml)
        if params.n != 1 or params.prompt_logprobs is not None:
            return self._local(d, xfer, tokens)
        k = self.eligible
        self.eligible += 1
        need = blocks_for(tokens, self.block_size)
        if self.auto:
            free_kv = tokens if self.kv_cap is None else self.kv_cap - self.local[d]
            if not picks_auto(OffloadCandidate(need, self.free[p], tokens, free_kv)):
                return self._local(d, xfer, tokens)
        elif not picks_by_ratio(k, self.ratio):
            return self._local(d, xfer, tokens)
        elif need > self.free[p]:
            self.no_room += 1
            return self._local(d, xfer, tokens)
        self.free[p] -= need
        self.held[xfer] = (p, need)
        self.offloaded += 1
        return tokens

    def _local(self, d: int, xfer: int, tokens: int) -> int:
        self.local[d] += tokens
        self.held_local[xfer] = (d, tokens)
        return 0

    def is_offloaded(self, xfer: int) -> bool:
        return xfer in self.held

    def decoding(self, request_id: str, xfer: int) -> None:
        if xfer in self.held or xfer in self.held_local:
            self.xfer_of[request_id] = xfer

    def credit(self, xfer: Optional[int]) -> None:
        held = self.held.pop(xfer, None) if xfer is not None else None
        if held is not None:
            self.free[held[0]] += held[1]
        loc = self.held_local.pop(xfer, None) if xfer is not None else None
        if loc is not None:
            self.local[loc[0]] -= loc[1]

    def finished(self, request_id: str) -> None:
        self.credit(self.xfer_of.pop(request_id, None))
