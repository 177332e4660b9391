"""One sample's progress through its grammar (an xgrammar matcher), and the step's masks.

A ``GrammarState`` follows its sample's output tokens: ``sync`` feeds the matcher the tokens it
has not seen (one per step; after a PD handoff or a re-plan, which carry no native state, the
whole output again) and says whether the sample must end: the grammar terminated (``"stop"``)
or rejected the sampled token (``DEAD_END``: the other masks left no token the grammar
allows). With ``start_after`` the grammar starts after the output's text first holds that
marker (the tokens up to it are free and never reach the matcher). Pickled, it keeps only its
spec; the matcher is rebuilt where it lands."""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

import torch

from .errors import RequestError
from .grammar import Grammars

log = logging.getLogger("megainfer.engine")

DEAD_END = "grammar_dead_end"  # the finish reason of a sample the grammar could not continue


class GrammarState:
    def __init__(self, spec, grammars: Optional[Grammars] = None):
        self.spec = spec
        self.future = grammars.future(spec) if grammars is not None else None
        self.matcher = None
        self.seen = 0  # output tokens the matcher accepted (after ``start``)
        self.start = 0 if spec.start_after is None else None  # where the grammar starts
        self.scanned = 0  # output tokens searched for the start_after marker

    def started(self, tokens: Sequence[int], grammars: Grammars) -> bool:
        """Whether the grammar applies from here on (``start_after`` seen in the output)."""
        if self.start is None:
            marker = self.spec.start_after
            k = len(marker.encode()) + 1  # tokens enough to spell it (a byte a token at worst)
            while self.scanned < len(tokens):
                self.scanned += 1
                tail = tokens[max(0, self.scanned - k):self.scanned]
                if marker in grammars.tokenizer.decode(tail, skip_special_tokens=False):
                    self.start = self.scanned
                    break
        return self.start is not None

    def __getstate__(self):
        return {"spec": self.spec}

    def __setstate__(self, state):
        self.__init__(state["spec"])

    def _matcher(self, grammars: Grammars):
        """The matcher (built once the grammar is compiled); None when the grammar did not
        compile here (intake compiled it, so only a rank with another vocabulary gets here):
        the sample then ends as a dead end instead of failing the step."""
        if self.matcher is None:
            import xgrammar as xgr  # lazy: ~3 s and transformers (grammar.py)
            if self.future is None:
                self.future = grammars.future(self.spec)
            try:
                compiled = self.future.result()
            except RequestError as e:
                log.warning("grammar of a request does not compile on this rank: %s", e)
                return None
            self.matcher = xgr.GrammarMatcher(compiled,
                                              override_stop_tokens=grammars.stop_ids or None,
                                              terminate_without_stop_token=not grammars.stop_ids)
            self.seen = 0
        return self.matcher

    def sync(self, tokens: Sequence[int], grammars: Grammars) -> Optional[str]:
        """Accept the tokens it has not seen; the finish reason the sample now has, or None."""
        if not self.started(tokens, grammars):
            return None
        m = self._matcher(grammars)
        if m is None:
            return DEAD_END
        while self.start + self.seen < len(tokens):
            if m.is_terminated():
                return "stop"
            if not m.accept_token(tokens[self.start + self.seen]):
                return DEAD_END
            self.seen += 1
        return "stop" if m.is_terminated() else None

    def fill(self, bitmask: torch.Tensor, row: int, tokens: Sequence[int],
             grammars: Grammars) -> None:
        """Row ``row`` of ``bitmask`` [R, ceil(V / 32)] int32: the tokens allowed next."""
        self.sync(tokens, grammars)
        m = self.matcher
        if m is None or m.is_terminated():  # nothing allowed / only stop tokens are left
            bitmask[row].zero_()
            return
        m.fill_next_token_bitmask(bitmask, row)


def grammar_masks(reqs, grammars: Grammars, V: int) -> tuple[list[int], Optional[torch.Tensor]]:
    """The rows of ``reqs`` under a grammar and their bitmask [len(rows), ceil(V / 32)] int32
    (host), None when no row has one."""
    rows = []
    for i, r in enumerate(reqs):
        if r.params.structured_outputs is not None:
            if r.grammar is None:
                r.grammar = GrammarState(r.params.structured_outputs, grammars)
            if r.grammar.started(r.output_token_ids, grammars):
                rows.append(i)
    if not rows:
        return rows, None
    bitmask = torch.empty(len(rows), (V + 31) // 32, dtype=torch.int32)
    for j, i in enumerate(rows):
        reqs[i].grammar.fill(bitmask, j, reqs[i].output_token_ids, grammars)
    return rows, bitmask


class MaskFiller:
    """A step's ``grammar_masks`` made on a background thread while its forward runs."""

    def __init__(self, grammars: Grammars, V: int):
        self.grammars, self.V, self.pool = grammars, V, None

    def start(self, reqs) -> Optional[Future]:
        """The future masks of ``reqs`` (the step's samples in sampling order); None when no
        sample has a grammar."""
        if not any(r.params.structured_outputs is not None for r in reqs):
            return None
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self.pool.submit(grammar_masks, reqs, self.grammars, self.V)


def apply_bitmask(x: torch.Tensor, rows, bitmask: torch.Tensor) -> None:
    """x [R, V] in place: rows ``rows`` [G] keep only the tokens their bitmask
    [G, ceil(V / 32)] (int32, on x's device) allows; the others go to -inf. On the host:
    xgrammar's kernel (``rows`` a list); elsewhere torch ops (``rows`` on x's device)."""
    V = x.shape[1]
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous():
        import xgrammar as xgr  # lazy: ~3 s and transformers (grammar.py)
        full = torch.full((x.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = bitmask
        xgr.apply_token_bitmask_inplace(x, full, vocab_size=V, indices=list(rows))
        return
    rows = torch.as_tensor(rows, device=x.device)
    bits = torch.arange(32, device=x.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).reshape(bitmask.shape[0], -1)[:, :V].bool()
    sub = x.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    x.index_copy_(0, rows, sub)
