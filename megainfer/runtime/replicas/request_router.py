"""Rank 0's hand-out of requests to attention replicas, a few at a time (``scheduler.routing``).

Every iteration each replica reports its queue (waiting, running) and the prefix-cache block
keys its tiers gained or lost (``BlockManager.take_key_events``); the router keeps each
replica's keys and hands out pending requests, first come first served, while some replica
has room (fewer than ``max_num_seqs + slack`` queued). ``round_robin``: the next replica with
room. ``cache_aware``: the replica holding the longest run of the prompt's full blocks (keyed
with ``chain_block_keys``, the block manager's chain), skipping one whose queue exceeds the
shortest by more than ``balance_abs``; ties to the shortest queue, then in rotation. A handed-
out request's keys count as expected on its replica until reported (or ``expect_iters``).
docs/kv_cache.md, "Cache-aware routing across attention replicas (`scheduler.routing`)"."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from megainfer.config.runtime import ROUTINGS
from megainfer.engine.block_manager import chain_block_keys
from megainfer.engine.errors import RequestError
from megainfer.engine.intake import tokenize_prompt


def tracks_keys(routing: str, num_replicas: int, prefix_caching: bool) -> bool:
    """Whether the replicas (attention or prefill) must report their prefix-cache key events:
    the one rule for it (cache-aware routing over more than one replica, prefix caching on)."""
    return routing == "cache_aware" and num_replicas > 1 and prefix_caching


def prompt_tokens_of(engine) -> Callable:
    """Rank 0's view of a request for routing: its prompt token ids, or None when it is invalid
    (the replica that gets it reports the error)."""
    def tokens(inp) -> Optional[list[int]]:
        try:
            return tokenize_prompt(engine.tokenizer, inp.prompt, inp.prompt_token_ids,
                                   engine.model_config.vocab_size, engine.max_model_len)[1]
        except RequestError:
            return None
    return tokens


@dataclass
class ReplicaView:
    """What rank 0 knows of one replica."""

    waiting: int = 0
    running: int = 0
    held: dict = field(default_factory=dict)  # key -> holders (first tier, second tier)
    expected: dict = field(default_factory=dict)  # key -> iteration it was routed

    @property
    def queue(self) -> int:
        return self.waiting + self.running

    def apply(self, events: Sequence[tuple[int, int]]) -> None:
        for key, d in events:
            n = self.held.get(key, 0) + d
            if n > 0:
                self.held[key] = n
                self.expected.pop(key, None)
            else:
                self.held.pop(key, None)

    def has(self, key: int) -> bool:
        return key in self.held or key in self.expected


class RequestRouter:
    """``tokens_of(input) -> token ids or None`` (None: routed without a prefix match)."""

    def __init__(self, num_replicas: int, policy: str, block_size: int, max_num_seqs: int,
                 tokens_of: Callable, slack: Optional[int] = None,
                 balance_abs: Optional[int] = None, expect_iters: int = 64,
                 use_keys: bool = True):
        if policy not in ROUTINGS:
            raise ValueError(f"scheduler.routing={policy!r}: must be one of {', '.join(ROUTINGS)}")
        self.policy, self.block_size, self.tokens_of = policy, block_size, tokens_of
        self.use_keys = use_keys  # False: prefix caching is off, there are no keys to match
        self.cap = max_num_seqs + (max(1, max_num_seqs // 4) if slack is None else slack)
        self.balance_abs = max(2, max_num_seqs // 2) if balance_abs is None else balance_abs
        self.expect_iters, self.iteration, self.next = expect_iters, 0, 0
        self.replicas = [ReplicaView() for _ in range(num_replicas)]
        self.pending: deque = deque()
        self.assigned = [0] * num_replicas  # requests handed to each replica
        self.matched_blocks = 0  # blocks of the routed prompts found on their replica

    @property
    def tracks_keys(self) -> bool:
        """Whether the replicas must report their key events."""
        return tracks_keys(self.policy, len(self.replicas), self.use_keys)

    def add(self, inputs) -> None:
        self.pending.extend(inputs)

    def take(self, match: Callable):
        """Remove and return the first pending request ``match(request)`` accepts (None: not
        pending: handed out already, or unknown)."""
        for i, item in enumerate(self.pending):
            if match(item):
                del self.pending[i]
                return item
        return None

    def take_over(self, old: "RequestRouter") -> None:
        """A re-plan's router (another replica count): the old one's queue and counters, and
        its views of the replicas both have."""
        self.pending = old.pending
        self.iteration, self.matched_blocks = old.iteration, old.matched_blocks
        for i in range(min(len(old.replicas), len(self.replicas))):
            self.replicas[i] = old.replicas[i]
            self.assigned[i] = old.assigned[i]

    def update(self, replica: int, waiting: int, running: int, events=()) -> None:
        v = self.replicas[replica]
        v.waiting, v.running = waiting, running
        v.apply(events)

    def keys(self, inp) -> list[int]:
        """The keys of the full blocks a replica could serve (never the last token's)."""
        ids = self.tokens_of(inp) if self.tracks_keys else None
        if not ids:
            return []
        bs = self.block_size
        return chain_block_keys([], lambda i: ids[i * bs:(i + 1) * bs], (len(ids) - 1) // bs)

    def route(self) -> list[list]:
        """Hand out pending requests while some replica has room: per replica, its new ones."""
        out = [[] for _ in self.replicas]
        self.iteration += 1
        for v in self.replicas:  # expectations never confirmed (the request failed, ...)
            for k in [k for k, it in v.expected.items() if self.iteration - it > self.expect_iters]:
                del v.expected[k]
        while self.pending:
            room = [r for r, v in enumerate(self.replicas) if v.queue < self.cap]
            if not room:
                break
            inp = self.pending.popleft()
            keys = self.keys(inp)
            r, match = self._choose(room, keys)
            out[r].append(inp)
            v = self.replicas[r]
            v.waiting += 1
            for k in keys[match:]:
                v.expected.setdefault(k, self.iteration)
            self.assigned[r] += 1
            self.matched_blocks += match
        return out

    def _choose(self, room: list[int], keys: list[int]) -> tuple[int, int]:
        A = len(self.replicas)
        order = sorted(room, key=lambda r: (r - self.next) % A)  # rotation from self.next
        if self.policy == "round_robin":
            self.next = (order[0] + 1) % A
            return order[0], 0
        shortest = min(self.replicas[r].queue for r in room)
        fit = [r for r in order if self.replicas[r].queue <= shortest + self.balance_abs]
        best, best_key = fit[0], None
        for r in fit:
            v, m = self.replicas[r], 0
            while m < len(keys) and v.has(keys[m]):
                m += 1
            key = (-m, v.queue)  # longest match, then shortest queue, then rotation
            if best_key is None or key < best_key:
                best, best_key = r, key
        self.next = (best + 1) % A
        return best, -best_key[0]
