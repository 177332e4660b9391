"""LLMEngine: requests in, new tokens and finished outputs out, one ``step()`` at a time.

A step, as nano-vllm's: ``schedule`` (the scheduler's batch, copy-on-write block copies, second
tier loads) -> ``execute`` (``StepInput.from_batch`` -> the executor's logits, rows laid out by
``StepInput.logit_rows``) -> ``postprocess`` (sample and log-probabilities, fork the samples of
``n`` > 1 requests whose prompt just completed, update requests) -> ``StepOutputs`` (each
sample's new token, finished outputs). Requests may be added and aborted between steps. The
engine owns the requests, the scheduler, the block manager, the KV cache tensors, the sampler
and the tokenizer; the executor (injected as a factory that receives the KV caches) only
computes logits. Everything is deterministic: the same calls give the same schedule and the
same tokens on every rank that runs them.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import torch

from megainfer.config import CacheConfig, ConfigError, ModelConfig, SchedulerConfig
from megainfer.models.kv_spec import KVCacheSpec, kv_cache_spec_for

from .block_manager import BlockManager
from .cuda_graphs import DecodeGraphs
from .grammar import Grammars
from .grammar_state import GrammarState, MaskFiller
from .kv_tier import make_kv_tier
from .errors import DuplicateRequestError, RequestError
from .intake import TokenizedPrompt, tokenize_request
from .outputs import (PromptInput, RequestOutput, SampleDelta, StepOutputs, logprob_dict,
                      request_output)
from .request import Request
from .sampler import PromptLogprobJob, Sampler, mix_seed
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sizing import check_cache_fits, check_kv_cache_dtype
from .local_online import LocalOnline
from .step import LocalExecutor, ModelExecutor, StepInput
from .tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger("megainfer.engine")

ExecutorFactory = Callable[[list[torch.Tensor]], ModelExecutor]


class LLMEngine(LocalOnline):
    def __init__(self, model_config: ModelConfig, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, executor_factory: ExecutorFactory,
                 tokenizer: Optional[Tokenizer] = None, *,
                 kv_spec: Optional[KVCacheSpec] = None,
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
        # the model's cache spec (GQA [2, NB, BS, Hkv, D] or MLA latent [NB, BS, R+P] per layer)
        self.kv_spec = kv_spec or kv_cache_spec_for(model_config, dtype=kv_dtype)
        if (self.kv_spec.kv_format, self.kv_spec.kv_granularity) != (
                cache_config.kv_cache_dtype, cache_config.kv_scale_granularity):  # as configured
            check_kv_cache_dtype(model_config, cache_config.kv_cache_dtype)
            self.kv_spec = dataclasses.replace(self.kv_spec, kv_format=cache_config.kv_cache_dtype,
                                               kv_granularity=cache_config.kv_scale_granularity)
        self.kv_caches = self.kv_spec.allocate(cache_config.num_blocks, cache_config.block_size,
                                               self.device, kv_dtype)
        self.kv_tier = make_kv_tier(cache_config, self.kv_spec, self.kv_caches, log_prefix)
        self.blocks = BlockManager(cache_config.num_blocks, cache_config.block_size,
                                   cache_config.enable_prefix_caching, self.kv_tier)
        self.scheduler = Scheduler(scheduler_config, self.blocks)
        self.executor = executor_factory(self.kv_caches)
        if self.kv_tier is not None and isinstance(self.executor, LocalExecutor):
            self.kv_tier.attach(self.executor.model.layers)  # cuda: a layer waits for its blocks
        self.grammars = Grammars(self.tokenizer, model_config.vocab_size,
                                 model_config.eos_token_id)
        self.sampler = Sampler(self.grammars)
        self.mask_filler = MaskFiller(self.grammars, model_config.vocab_size)
        self.requests: dict[str, Request] = {}  # unfinished, by request id
        self.log_prefix = log_prefix
        self._next_seq_id = 0
        self.num_steps = self.num_generated_tokens = self.last_step_tokens = 0
        self.num_computed_prompt_tokens = 0  # prompt tokens fed to the model (recompute included,
        # prefix-cache hits excluded)
        self.num_block_copies = 0  # copy-on-write copies of shared blocks
        self.detokenize = True  # finished outputs carry their text (False: the frontend decodes)
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
                graphs = DecodeGraphs(model, kv, cache_config.block_size,
                                      scheduler_config.max_num_seqs, scheduler_config.max_model_len)
            return LocalExecutor(model, kv, cache_config.block_size, graphs)
        kw.setdefault("kv_spec", model.kv_cache_spec(p.dtype))
        return cls(model.config, scheduler_config, cache_config, executor, tokenizer,
                   kv_dtype=p.dtype, device=p.device, **kw)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id, prompt: Union[str, Sequence[int], None] = None,
                    params: Optional[SamplingParams] = None, *,
                    prompt_token_ids: Optional[Sequence[int]] = None) -> Request:
        """Validate and queue one request; a ``RequestError`` refuses it and changes nothing."""
        params = SamplingParams() if params is None else params
        return self.add_tokenized(request_id, self.tokenize(prompt, params, prompt_token_ids),
                                  params)

    def tokenize(self, prompt, params: SamplingParams, prompt_token_ids=None) -> TokenizedPrompt:
        """A prompt validated into token ids, ``bad_words`` encoded; touches no engine state (a
        frontend calls it off the engine's loop)."""
        return tokenize_request(self.tokenizer, prompt, prompt_token_ids, params,
                                self.model_config.vocab_size, self.max_model_len, self.grammars)

    def add_tokenized(self, request_id, prompt: TokenizedPrompt, params: SamplingParams
                      ) -> Request:
        """Queue a request ``tokenize`` made; a ``RequestError`` refuses it, changing nothing."""
        rid = str(request_id)
        if rid in self.requests:
            raise DuplicateRequestError(f"request_id={rid!r}: already queued or running")
        if params.prompt_logprobs is not None and \
                not getattr(self.executor, "supports_full_logits", False):
            mode = getattr(self.executor, "deploy_mode", type(self.executor).__name__)
            raise RequestError(f"prompt_logprobs={params.prompt_logprobs}: not supported in "
                               f"deploy.mode={mode}")
        text, ids = prompt.prompt, prompt.prompt_token_ids
        seq_id = self._next_seq_id
        self._next_seq_id += params.n
        seed = params.seed if params.seed is not None else mix_seed(self.seed, seq_id)
        samples = []
        for i in range(params.n):  # sample i: seed derived from (request seed, i)
            samples.append(Request(
                seq_id + i, rid, text, ids, params, seed=seed if i == 0 else mix_seed(seed, -i),
                eos_token_ids=self.model_config.eos_token_id, max_model_len=self.max_model_len,
                index=i, logprobs=None if params.logprobs is None else []))
            samples[-1].bad_words_token_ids = prompt.bad_words_token_ids
            if params.structured_outputs is not None:  # compiles while the prompt prefills
                samples[-1].grammar = GrammarState(params.structured_outputs, self.grammars)
        req = samples[0]
        req.samples, req.pending, req.num_unfinished = samples, samples[1:], params.n
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id) -> Optional[RequestOutput]:
        req = self.requests.pop(str(request_id), None)
        if req is None:
            return None
        req.pending = []
        for s in req.samples:
            self.scheduler.finish(s)
            if not s.is_finished:
                s.finish("abort")
        return request_output(self.tokenizer, req, self.detokenize)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """One iteration (an empty one when nothing is scheduled); the finished outputs."""
        return self.step_outputs().finished

    def step_outputs(self) -> StepOutputs:
        """One iteration: schedule -> execute -> postprocess; every sample's new token and the
        finished outputs."""
        batch = self.schedule()
        step = StepInput.from_batch(batch.requests, batch.num_new_tokens)
        masks = self._start_masks(batch, step)  # grammar bitmasks, filled while the step runs
        logits = self.executor.execute(step)  # [rows of step.logit_rows(), V]
        return self.postprocess(batch, step, logits, masks)

    def _start_masks(self, batch: ScheduledBatch, step: StepInput):
        """The grammar bitmasks of the samples this step samples (``postprocess``'s order:
        each sampled row, then the samples forking from it), filling during the forward."""
        who = []
        for i in step.sample_rows:
            req = batch.requests[i]
            who += [req] + (req.pending if req.pending and not req.output_token_ids else [])
        return self.mask_filler.start(who)

    def schedule(self) -> ScheduledBatch:
        """The scheduler's batch, with the KV blocks it needs ready (copy-on-write copies done,
        second-tier hits back in their fresh blocks)."""
        batch = self.scheduler.schedule()
        copies = self.blocks.take_copies()
        if copies:
            self._copy_blocks(copies)
        if self.kv_tier is not None:
            self.kv_tier.apply_loads()
        return batch

    def postprocess(self, batch: ScheduledBatch, step: StepInput,
                    logits: torch.Tensor, masks=None) -> StepOutputs:
        """Advance the batch's requests by the step: cache their full blocks, sample the
        sequences that completed their known tokens (and prompt logprobs), fork the samples of
        requests whose prompt just completed, finish the requests that stop. ``masks``: the
        future of the samples' grammar bitmasks (``_start_masks``)."""
        now = time.perf_counter()
        rows, full, jobs, job_reqs = step.logit_rows(), set(step.full_logits), [], []
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            c, P = req.num_computed_tokens, req.num_prompt_tokens
            self.num_computed_prompt_tokens += max(0, min(c + n, P) - c)
            req.num_computed_tokens += n
            self.blocks.cache_full_blocks(req)  # prefix caching: full blocks become reusable
            if i in full:
                q0, q1 = max(c, len(req.prompt_logprobs) - 1), min(c + n, P - 1)
                if q1 > q0:  # row of position q predicts prompt token q + 1
                    jobs.append(PromptLogprobJob(rows[i].start + q0 - c,
                                                 req.prompt_token_ids[q0 + 1:q1 + 1],
                                                 req.params.prompt_logprobs))
                    job_reqs.append(req)
        sampled, sample_rows, forks = [], [], []
        for i in step.sample_rows:
            req, last = batch.requests[i], rows[i][-1]  # its next token comes from its last row
            sampled.append(req)
            sample_rows.append(last)
            if req.pending and not req.output_token_ids:  # prompt done: fork its samples
                forks += req.pending
                sampled += req.pending
                sample_rows += [last] * len(req.pending)
                for child in req.pending:
                    self.blocks.fork(req, child)
                    child.num_computed_tokens = req.num_computed_tokens
                req.pending = []
        res = self.sampler.run(logits, sampled, sample_rows, jobs,
                               None if masks is None else masks.result()) \
            if sampled or jobs else None
        for req, recs in zip(job_reqs, res.prompt if res is not None else []):
            targets = req.prompt_token_ids[len(req.prompt_logprobs):]
            req.prompt_logprobs += [logprob_dict(self.tokenizer, t, rec) for t, rec in zip(targets, recs)]
        forked, out = set(map(id, forks)), StepOutputs()
        for k, req in enumerate(sampled):
            tok, rec = res.tokens[k], res.logprobs[k]
            lp = None
            if rec is not None:
                lp = [logprob_dict(self.tokenizer, tok, rec)]
                req.logprobs += lp
                req.cumulative_logprob += rec[0]
            req.append_token(tok, now, self.tokenizer)
            if req.grammar is not None and not req.is_finished:
                ended = req.grammar.sync(req.output_token_ids, self.grammars)
                if ended is not None:
                    req.finish(ended, now)
            out.new_tokens.append(SampleDelta(req.request_id, req.index, [tok], lp,
                                              req.finish_reason, req.stop_reason))
            if id(req) in forked and not req.is_finished:  # it runs, or waits for a seat
                self.scheduler.add_running(req)
            if req.is_finished:
                self.scheduler.finish(req)
                head = self.requests[req.request_id]
                head.num_unfinished -= 1
                if head.num_unfinished == 0:
                    del self.requests[req.request_id]
                    out.finished.append(request_output(self.tokenizer, head, self.detokenize))
        self.num_steps += 1
        self.num_generated_tokens += len(sampled)
        self.last_step_tokens = batch.num_tokens
        return out

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of shared KV blocks, in the order they were decided (a block freed and
        reused within one schedule is read before it is overwritten), along the spec's block axis."""
        dim = self.kv_spec.block_axis
        for src, dst in copies:
            for kv in self.kv_caches:
                kv.select(dim, dst).copy_(kv.select(dim, src))
        self.num_block_copies += len(copies)

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
