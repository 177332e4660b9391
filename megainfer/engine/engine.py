"""LLMEngine: requests in, finished outputs out, one ``step()`` at a time.

A step is: schedule -> ``StepInput`` -> ``executor.execute`` -> sample -> update requests ->
finished outputs. The engine owns the requests, the scheduler, the block manager, the KV
cache tensors, the sampler and the tokenizer; the executor (injected as a factory that
receives the KV caches) only computes logits. Everything is deterministic: the same calls give
the same schedule and the same tokens on every rank that runs them.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import torch

from megainfer.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from megainfer.models.attention import allocate_kv_cache

from .block_manager import BlockManager
from .errors import (CacheTooSmallError, DuplicateRequestError, EmptyPromptError,
                     PromptTooLongError, RequestError, TokenIdError)
from .outputs import CompletionOutput, PromptInput, RequestMetrics, RequestOutput
from .request import Request
from .sampler import Sampler, mix_seed
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .step import LocalExecutor, ModelExecutor, StepInput
from .tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger("megainfer.engine")

ExecutorFactory = Callable[[list[torch.Tensor]], ModelExecutor]


def check_cache_fits(cache: CacheConfig, max_model_len: int) -> None:
    """Refuse at start-up a pool that cannot hold one request of max_model_len (no livelock)."""
    need = -(-max_model_len // cache.block_size)
    if cache.num_blocks < need:
        raise CacheTooSmallError(
            f"cache.num_blocks={cache.num_blocks}: a request of max_model_len={max_model_len} "
            f"tokens needs {need} blocks of {cache.block_size}; raise cache.num_blocks or lower "
            "scheduler.max_model_len")


class LLMEngine:
    def __init__(self, model_config: ModelConfig, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, executor_factory: ExecutorFactory,
                 tokenizer: Optional[Tokenizer] = None, *, kv_heads: Optional[int] = None,
                 kv_dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu",
                 seed: int = 0, log_prefix: str = "[attn dp0 tp0]"):
        self.model_config, self.scheduler_config = model_config, scheduler_config
        self.cache_config, self.device, self.seed = cache_config, torch.device(device), seed
        self.max_model_len = scheduler_config.max_model_len
        if self.max_model_len > model_config.max_position_embeddings:
            raise ConfigError(f"scheduler.max_model_len={self.max_model_len}: exceeds the model's "
                              f"max_position_embeddings={model_config.max_position_embeddings}")
        check_cache_fits(cache_config, self.max_model_len)
        self.tokenizer = tokenizer or ByteTokenizer(model_config.eos_token_id)
        self.blocks = BlockManager(cache_config.num_blocks, cache_config.block_size)
        self.scheduler = Scheduler(scheduler_config, self.blocks)
        self.kv_caches = allocate_kv_cache(
            model_config.num_layers, cache_config.num_blocks, cache_config.block_size,
            kv_heads or model_config.num_kv_heads, model_config.head_dim, kv_dtype, self.device)
        self.executor = executor_factory(self.kv_caches)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}  # unfinished, by request id
        self.log_prefix = log_prefix
        self._next_seq_id = 0
        self.num_steps = self.num_generated_tokens = self.last_step_tokens = 0
        log.info("%s engine: %d KV blocks x %d tokens, max_model_len=%d, max_num_seqs=%d, "
                 "max_num_batched_tokens=%d", log_prefix, cache_config.num_blocks,
                 cache_config.block_size, self.max_model_len, scheduler_config.max_num_seqs,
                 scheduler_config.max_num_batched_tokens)

    @classmethod
    def from_model(cls, model, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                   tokenizer: Optional[Tokenizer] = None, *, cuda_graphs: bool = False,
                   **kw) -> "LLMEngine":
        """Single mode: a ``LocalExecutor`` over a model built with role ``full``; the KV cache
        lives on the model's device in its dtype. ``cuda_graphs``: decode steps replay CUDA
        graphs (cuda and a graph-capturable attention backend only)."""
        p = next(model.parameters())

        def executor(kv):
            graphs = None
            if cuda_graphs and p.is_cuda and model.attention_backend.graphable:
                from .cuda_graphs import DecodeGraphs
                graphs = DecodeGraphs(model, kv, cache_config.block_size,
                                      scheduler_config.max_num_seqs, scheduler_config.max_model_len)
            return LocalExecutor(model, kv, cache_config.block_size, graphs)
        return cls(model.config, scheduler_config, cache_config, executor, tokenizer,
                   kv_dtype=p.dtype, device=p.device, **kw)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id, prompt: Union[str, Sequence[int], None] = None,
                    params: Optional[SamplingParams] = None, *,
                    prompt_token_ids: Optional[Sequence[int]] = None) -> Request:
        """Validate and queue one request; a ``RequestError`` refuses it and changes nothing."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params={params!r}: must be a SamplingParams")
        rid = str(request_id)
        if rid in self.requests:
            raise DuplicateRequestError(f"request_id={rid!r}: already queued or running")
        text, ids = self._tokenize(prompt, prompt_token_ids)
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        req = Request(seq_id, rid, text, ids, params,
                      seed=params.seed if params.seed is not None else mix_seed(self.seed, seq_id),
                      eos_token_ids=self.model_config.eos_token_id, max_model_len=self.max_model_len)
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def _tokenize(self, prompt, prompt_token_ids) -> tuple[Optional[str], list[int]]:
        if prompt_token_ids is None and not isinstance(prompt, str):
            prompt, prompt_token_ids = None, prompt
        if prompt is not None and prompt_token_ids is not None:
            raise RequestError("prompt and prompt_token_ids: give exactly one")
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPromptError("prompt='': empty prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            if prompt_token_ids is None or isinstance(prompt_token_ids, (str, bytes)):
                raise RequestError(f"prompt={prompt_token_ids!r}: must be text or a list of token ids")
            ids = list(prompt_token_ids)
            if not ids:
                raise EmptyPromptError("prompt_token_ids=[]: empty prompt")
        V = self.model_config.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V:
                raise TokenIdError(f"prompt_token_ids[{i}]={t!r}: must be an integer in "
                                   f"[0, vocab_size={V})")
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(f"prompt length={len(ids)} tokens: exceeds "
                                     f"max_model_len={self.max_model_len}")
        return prompt, ids

    def abort_request(self, request_id) -> Optional[RequestOutput]:
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return None
        self.scheduler.finish(req)
        req.finish("abort")
        return self._output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one iteration (an empty one when nothing is scheduled); return finished outputs."""
        batch = self.scheduler.schedule()
        step = self.build_step(batch)
        logits = self.executor.execute(step)  # [len(sample_rows), V]
        now = time.perf_counter()
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
        sampled = [batch.requests[i] for i in step.sample_rows]
        tokens = self.sampler(logits, sampled) if sampled else []
        finished = []
        for req, tok in zip(sampled, tokens):
            req.append_token(tok, now)
            if req.is_finished:
                self.scheduler.finish(req)
                del self.requests[req.request_id]
                finished.append(self._output(req))
        self.num_steps += 1
        self.num_generated_tokens += len(tokens)
        self.last_step_tokens = batch.num_tokens
        return finished

    def build_step(self, batch: ScheduledBatch) -> StepInput:
        if not batch.requests:
            return StepInput.empty()
        ids, pos, ctx, rows = [], [], [], []
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            c = req.num_computed_tokens
            ids += req.token_slice(c, c + n)
            pos += range(c, c + n)
            ctx.append(c)
            if c + n == req.num_tokens:
                rows.append(i)
        return StepInput(
            seq_ids=[r.seq_id for r in batch.requests], query_lens=list(batch.num_new_tokens),
            context_lens=ctx, block_tables=[list(r.block_table) for r in batch.requests],
            input_ids=torch.tensor(ids, dtype=torch.long),  # host tensors: the executor moves
            positions=torch.tensor(pos, dtype=torch.long), sample_rows=rows)  # them in one copy

    def _output(self, req: Request) -> RequestOutput:
        text = self.tokenizer.decode(req.output_token_ids)
        return RequestOutput(
            req.request_id, req.prompt, req.prompt_token_ids,
            [CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason)], True,
            RequestMetrics(req.arrival_time, req.first_token_time, req.finish_time,
                           req.num_preemptions))

    # ------------------------------------------------------------------ streaming
    def add_inputs(self, inputs: Iterable[PromptInput], warn: bool = True
                   ) -> tuple[dict, list[RequestOutput]]:
        """Queue every valid input. Returns (engine request id -> caller's id, failed outputs
        naming the culprit of each invalid input); the valid ones run regardless."""
        ids, failed = {}, []
        for inp in inputs:
            try:
                req = self.add_request(inp.request_id, inp.prompt, inp.params,
                                       prompt_token_ids=inp.prompt_token_ids)
                ids[req.request_id] = inp.request_id
            except RequestError as e:
                if warn:
                    log.warning("%s request %r refused: %s", self.log_prefix, inp.request_id, e)
                failed.append(RequestOutput.failed(inp.request_id, inp.prompt,
                                                   inp.prompt_token_ids, e))
        return ids, failed

    def generate_stream(self, inputs: Iterable[PromptInput]) -> Iterator[RequestOutput]:
        """Queue every input, then step until all finish, yielding each output as it finishes.
        An invalid input yields at once a failed output (finish_reason "error") naming the
        culprit; the others run. Outputs carry the caller's request ids unchanged."""
        ids, failed = self.add_inputs(inputs)
        yield from failed
        while self.has_unfinished():
            for out in self.step():
                out.request_id = ids.pop(out.request_id, out.request_id)
                yield out
            if self.last_step_tokens == 0:  # cannot happen with a pool checked at start-up
                raise RuntimeError(f"{self.log_prefix} scheduler made no progress with "
                                   f"{len(self.requests)} requests unfinished")
