"""The seam between the engine and whatever computes a step.

The engine turns the scheduler's batch into a ``StepInput``; a ``ModelExecutor`` turns it into
logits for the sequences that need a next token. ``LocalExecutor`` runs the whole model in this
process (single mode); the disaggregated runtime supplies its own executor (attention here,
experts on other ranks, micro-batches via ``StepInput.split``). An empty step (no sequences)
is legal: an idle replica still calls its executor so every replica advances in lockstep.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, runtime_checkable

import torch

from megainfer.models.attention import AttentionMetadata


@dataclass
class StepInput:
    """One step's batch, flat: T tokens from S sequences, sequence after sequence."""

    seq_ids: list[int]  # request ids in batch order
    query_lens: list[int]  # new tokens per sequence (a prefill chunk, or 1 for a decode)
    context_lens: list[int]  # tokens already in the KV cache per sequence
    block_tables: list[list[int]]
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    sample_rows: list[int]  # sequence indices that need a next token this step, ascending
    # sequence indices (ascending) that want the logits of *every* new token (prompt logprobs)
    full_logits: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, device: str | torch.device = "cpu") -> "StepInput":
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls([], [], [], [], z, z.clone(), [])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def is_empty(self) -> bool:
        return not self.seq_ids

    def token_offsets(self) -> list[int]:
        """[S+1] start of each sequence's tokens in the flat batch."""
        out = [0]
        for n in self.query_lens:
            out.append(out[-1] + n)
        return out

    @classmethod
    def from_batch(cls, requests, num_new_tokens) -> "StepInput":
        """The scheduler's batch (``num_new_tokens[i]`` tokens of ``requests[i]``) as one flat
        step: a sequence is sampled when the step completes all its known tokens, and wants every
        row's logits while its chunk holds prompt positions still without logprobs."""
        if not requests:
            return cls.empty()
        ids, pos, ctx, rows, full = [], [], [], [], []
        for i, (req, n) in enumerate(zip(requests, num_new_tokens)):
            c = req.num_computed_tokens
            ids += req.token_slice(c, c + n)
            pos += range(c, c + n)
            ctx.append(c)
            if c + n == req.num_tokens:
                rows.append(i)
            pl = req.prompt_logprobs
            if pl is not None and len(pl) < req.num_prompt_tokens and c + n > len(pl) - 1:
                full.append(i)
        return cls(seq_ids=[r.seq_id for r in requests], query_lens=list(num_new_tokens),
                   context_lens=ctx, block_tables=[list(r.block_table) for r in requests],
                   input_ids=torch.tensor(ids, dtype=torch.long),  # host tensors: the executor
                   positions=torch.tensor(pos, dtype=torch.long),  # moves them in one copy
                   sample_rows=rows, full_logits=full)

    def logit_rows(self) -> dict[int, range]:
        """The logits-row layout (its one owner): sequence index -> its rows of the executor's
        logits, in batch order: every new token's row for a ``full_logits`` sequence, the last
        token's row for one in ``sample_rows``, none for the others. The last row of a sampled
        sequence is the one its next token is sampled from."""
        full, want, out, r = set(self.full_logits), set(self.sample_rows), {}, 0
        for i, n in enumerate(self.query_lens):
            k = n if i in full else 1 if i in want else 0
            if k:
                out[i] = range(r, r + k)
                r += k
        return out

    def logit_token_list(self, order: Optional[list[int]] = None) -> list[int]:
        """The token behind each logits row (``logit_rows`` order), as its index in the step's
        hidden states: laid out sequence after sequence in batch order, or in ``order`` (a
        permutation of the sequence indices, e.g. micro-batches concatenated)."""
        order = range(self.num_seqs) if order is None else order
        start, base = {}, 0  # sequence index -> index of its first new token in that layout
        for s in order:
            start[s], base = base, base + self.query_lens[s]
        out = []
        for s, rows in self.logit_rows().items():
            end = start[s] + self.query_lens[s]
            out += range(end - len(rows), end)
        return out

    def sample_token_indices(self, order: Optional[list[int]] = None) -> torch.Tensor:
        """``logit_token_list`` as a tensor on the inputs' device."""
        return torch.tensor(self.logit_token_list(order), dtype=torch.long,
                            device=self.input_ids.device)

    def split(self, groups: list[list[int]]) -> list["StepInput"]:
        """Micro-batches: ``groups[g]`` lists sequence indices (ascending). ``sample_rows`` of each
        part index its own sequences; logits of the parts, concatenated in group order, are the
        whole step's logits when the groups are contiguous and in order."""
        offs = self.token_offsets()
        want, full = set(self.sample_rows), set(self.full_logits)
        parts = []
        starts_all = torch.tensor(offs[:-1], dtype=torch.long)
        for g in groups:
            gi = torch.tensor(g, dtype=torch.long)
            lens = torch.tensor([self.query_lens[i] for i in g], dtype=torch.long)  # [S_g]
            first = torch.repeat_interleave(starts_all[gi] - torch.cumsum(lens, 0) + lens, lens)
            idx = (first + torch.arange(int(lens.sum()))).to(self.input_ids.device)  # [T_g]
            parts.append(StepInput(
                seq_ids=[self.seq_ids[i] for i in g], query_lens=[self.query_lens[i] for i in g],
                context_lens=[self.context_lens[i] for i in g],
                block_tables=[self.block_tables[i] for i in g],
                input_ids=self.input_ids[idx], positions=self.positions[idx],
                sample_rows=[j for j, i in enumerate(g) if i in want],
                full_logits=[j for j, i in enumerate(g) if i in full]))
        return parts

    def attention_metadata(self, block_size: int,
                           device: Optional[str | torch.device] = None) -> AttentionMetadata:
        return AttentionMetadata.build(self.query_lens, self.context_lens, self.block_tables,
                                       block_size, device or self.input_ids.device)


@runtime_checkable
class ModelExecutor(Protocol):
    def execute(self, step: StepInput) -> torch.Tensor:
        """-> logits float32, one row per ``step.logit_token_list()`` entry: [len(sample_rows),
        V] unless ``full_logits`` is set. An executor that cannot return every row's logits
        says so with ``supports_full_logits = False`` (the engine then refuses
        ``prompt_logprobs``)."""
        ...


class LocalExecutor:
    """Single mode: the whole model over the engine's paged KV cache, logits of sampled rows.

    The step's host lists become device tensors through one copy per step
    (``AttentionMetadata.build_with``); with ``graphs`` (cuda) pure decode steps replay CUDA
    graphs instead (``megainfer.engine.cuda_graphs``)."""

    supports_full_logits = True

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, graphs=None):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.vocab_size = model.config.vocab_size
        self.device = kv_caches[0].device if kv_caches else torch.device("cpu")
        self.graphs = graphs

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        if step.is_empty():
            return torch.zeros(0, self.vocab_size, dtype=torch.float32, device=self.device)
        if self.graphs is not None and self.graphs.fits(step.query_lens, step.block_tables):
            logits = self.graphs.run(step.input_ids.tolist(), step.positions.tolist(),
                                     step.block_tables)  # one row per sequence
            rows = step.logit_token_list()  # = sequence indices: one token each
            if len(rows) == step.num_seqs:
                return logits
            return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        meta, (ids, pos, rows) = AttentionMetadata.build_with(
            step.query_lens, step.context_lens, step.block_tables, self.block_size, self.device,
            extras=[step.input_ids, step.positions, step.sample_token_indices()])
        hidden = self.model(ids, pos, meta, self.kv_caches)  # [T, H]
        return self.model.compute_logits(hidden[rows])  # [R, V]
