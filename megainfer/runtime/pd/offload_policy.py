"""Rank 0's choice of the requests whose decode attention runs on their prefill rank
(``pd.offload``).

At hand-out, a request with one sample and no prompt logprobs is offloaded by
``perfmodel/offload_rule.py``'s rule (the one the PD simulator applies): with
``pd.offload_policy=ratio`` when the fixed fraction ``pd.offload_ratio`` says so and its prefill
rank's pool has room for its whole life, ``min(prompt + max_tokens, max_model_len)`` tokens,
reserved up front; with ``auto`` when that pool has room and its decode replica's KV
(``cache.num_blocks`` blocks) would not hold it beside the local requests rank 0 has given that
replica (their whole lives). Rank 0 keeps the ledger: the room comes back when the request's
output reaches rank 0 or it is dropped at the prefill rank, or when it is sent home
(``offload_home``): a request the policy would offload whose pool is short sends requests
decoding from that pool home, oldest first, while their decode replicas' KV holds their whole
lives (``pd.offload_return_home``). ``auto``'s TPOT condition: with ``slo.tpot_ms`` set, the
prediction is rank 0's last decode iteration plus the latest per-layer round trip at every
layer (``observe``, from the replicas' reports), the rule the simulator applies; and only
while the prefill rank's measured busy share over the last second (its prefill steps and the
offloaded attention it served, from its reports: ``prefill_busy``) is at most
``pd.offload_max_prefill_busy``.
docs/pd.md, "Decode attention offloaded to the prefill ranks".
"""
from __future__ import annotations

import time
from collections import deque
from typing import Optional

from megainfer.perfmodel.offload_rule import (Decoding, OffloadCandidate, blocks_for,
                                             homes_for_room, picks_auto, picks_by_ratio)

BUSY_WINDOW_S = 1.0  # auto: a prefill rank's busy share is measured over about this long


class OffloadLedger:
    def __init__(self, ratio: float, pool_blocks: int, num_prefill: int, block_size: int,
                 max_model_len: int, policy: str = "ratio", num_decode: int = 1,
                 decode_kv_tokens: Optional[int] = None, return_home: bool = True,
                 tpot_slo_s: Optional[float] = None, num_layers: int = 1,
                 max_prefill_busy: float = 1.0):
        self.ratio, self.block_size, self.max_model_len = ratio, block_size, max_model_len
        self.pool_blocks, self.auto = pool_blocks, policy == "auto"
        self.return_home = return_home
        self.free = [pool_blocks] * num_prefill  # per prefill rank: pool blocks not promised
        self.held: dict[int, tuple[int, int]] = {}  # xfer -> (prefill index, blocks)
        self.life: dict[int, tuple[int, int]] = {}  # offloaded xfer -> (decode replica, tokens)
        self.kv_cap = decode_kv_tokens  # a decode replica's KV, tokens (None: unlimited)
        self.local = [0] * num_decode  # per decode replica: whole-life tokens of its local requests
        self.held_local: dict[int, tuple[int, int]] = {}  # local xfer -> (decode replica, tokens)
        self.xfer_of: dict[str, int] = {}  # request id -> xfer, once it decodes
        self.homes: list[tuple[int, int]] = []  # (decode replica, xfer) sent home, not told yet
        self.tpot_slo_s, self.L = tpot_slo_s, num_layers
        self.iteration_s: Optional[float] = None  # the last decode iteration's wall time
        self.round_trip_s: Optional[float] = None  # the latest mean per-layer round trip
        self.max_busy = max_prefill_busy  # auto: a prefill rank busier than this takes none
        self.busy = [deque() for _ in range(num_prefill)]  # per prefill rank: (t, busy_s so far)
        self.eligible = 0  # requests that could have been offloaded
        self.offloaded = 0  # requests offloaded
        self.no_room = 0  # chosen by the ratio but the pool was full (and none could go home)
        self.sent_home = 0  # offloaded requests sent home for the room
        self.over_tpot = 0  # auto: left local since the predicted TPOT broke the SLO
        self.no_spare = 0  # auto: left local since its prefill rank had no spare time

    def prefill_busy(self, p: int, busy_s: float, t: float) -> None:
        """Prefill rank ``p``'s report at rank 0's time ``t``: seconds busy so far (its prefill
        steps and the offloaded attention it served)."""
        samples = self.busy[p]
        samples.append((t, busy_s))
        while len(samples) > 2 and samples[1][0] <= t - BUSY_WINDOW_S:
            samples.popleft()  # the one before the window stays: the window's start

    def busy_fraction(self, p: int, now: Optional[float] = None) -> Optional[float]:
        """The share of the last ``BUSY_WINDOW_S`` (from the latest report before it) prefill
        rank ``p`` was busy, up to ``now``; None before two reports. A rank silent since its
        last report was idle since (it reports after every step)."""
        samples = self.busy[p]
        if len(samples) < 2:
            return None
        now = time.perf_counter() if now is None else now
        (t0, b0), (_, b1) = samples[0], samples[-1]
        return min(1.0, (b1 - b0) / max(now - t0, 1e-9))

    def observe(self, iteration_s: float, round_trips: tuple) -> None:
        """Rank 0's last decode iteration (s) and the per-layer round trips reported in it."""
        self.iteration_s = iteration_s
        if round_trips:
            self.round_trip_s = sum(round_trips) / len(round_trips)

    def predicted_tpot_s(self) -> Optional[float]:
        """The TPOT with one more request offloaded: the last decode iteration plus the
        latest per-layer round trip at every layer (the simulator's rule); None before a
        decode iteration and a round trip were measured."""
        if self.iteration_s is None or self.round_trip_s is None:
            return None
        return self.iteration_s + self.L * self.round_trip_s

    def decide(self, p: int, d: int, xfer: int, inp, num_prompt_tokens: int,
               now: Optional[float] = None) -> int:
        """Tokens prefill rank ``p`` keeps room for (0: the request's KV is streamed to decode
        replica ``d``). A request the policy would offload whose pool is short sends decoding
        requests of that pool home when their decode replicas' KV holds them (``take_homes``)."""
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
            tpot = self.predicted_tpot_s()
            ahead = OffloadCandidate(need, need, tokens, free_kv, tpot, self.tpot_slo_s)
            if not picks_auto(ahead):  # no pressure, or the TPOT SLO: the pool aside
                self.over_tpot += tokens > free_kv
                return self._local(d, xfer, tokens)
            busy = self.busy_fraction(p, now)
            if busy is not None and busy > self.max_busy:  # its prefill rank has no time
                self.no_spare += 1
                return self._local(d, xfer, tokens)
        elif not picks_by_ratio(k, self.ratio):
            return self._local(d, xfer, tokens)
        if need > self.free[p] and not self._make_room(p, need):
            self.no_room += 1
            return self._local(d, xfer, tokens)
        self.free[p] -= need
        self.held[xfer] = (p, need)
        self.life[xfer] = (d, tokens)
        self.offloaded += 1
        return tokens

    def _make_room(self, p: int, need: int) -> bool:
        """Send requests decoding from pool ``p`` home, oldest first, each while its decode
        replica's KV holds its whole life beside the local ones, until ``need`` blocks are
        free; nothing is sent unless that many can be (True then)."""
        if not self.return_home:
            return False
        decoding = [Decoding(x, self.held[x][1], *self.life[x])
                    for x in sorted(set(self.xfer_of.values())) if self.held.get(x, (None,))[0] == p]
        go = homes_for_room(need, self.free[p], decoding, self.local, self.kv_cap)
        if go is None:
            return False
        for h in go:
            x = h.key
            self.free[p] += self.held.pop(x)[1]
            dx, tx = self.life.pop(x)
            self.local[dx] += tx
            self.held_local[x] = (dx, tx)
            self.homes.append((dx, x))
            self.sent_home += 1
        return True

    def take_homes(self) -> list[tuple[int, int]]:
        """(decode replica, xfer) of the requests sent home since the last call."""
        out, self.homes = self.homes, []
        return out

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
            self.life.pop(xfer, None)
        loc = self.held_local.pop(xfer, None) if xfer is not None else None
        if loc is not None:
            self.local[loc[0]] -= loc[1]

    def finished(self, request_id: str) -> None:
        self.credit(self.xfer_of.pop(request_id, None))
