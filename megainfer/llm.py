"""The offline Python API (vLLM-shaped): ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import logging
import weakref
from typing import Iterable, Iterator, Mapping, Optional, Sequence, Union

from tqdm.auto import tqdm

from megainfer.config import ConfigError, ResolvedJob, ModelConfig
from megainfer.config.runtime import DEFAULT_KV_SCALE_GRANULARITY
from megainfer.core_client.client import open_sync
from megainfer.engine.job_doors import LLMJob, resolve_llm_job
from megainfer.engine_core.builder import mpi_world
from megainfer.engine import PromptInput, RequestError, RequestOutput, SamplingParams
from megainfer.engine.chat_template import ChatRenderer, encode_chat
from megainfer.engine_core.core import SHUTDOWN_TIMEOUT_S
from megainfer.engine.tokenizer import Tokenizer

Prompt = Union[str, Sequence[int], dict]
log = logging.getLogger("megainfer.engine")


class LLM:
    """One model, vLLM's constructor names where they mean the same thing.

    ``model``: a checkpoint directory, a Hugging Face model id (``"org/name"``, read from the
    local HF cache at ``revision``; nothing is downloaded), or a ``ModelConfig`` (then
    ``load_format`` is dummy: seeded random weights drawn straight onto the device).
    ``trust_remote_code=True`` is refused: megainfer runs its own model code only.
    ``seed`` seeds the sampling of requests without their own seed (and dummy weights).
    ``device``: ``cpu`` | ``cuda`` (default: cuda when one is visible); ``dtype``: ``float32`` |
    ``bfloat16`` | ``float16`` (default: bfloat16 on cuda, float32 on cpu); ``quantization``:
    how weights are kept (``model.quantization``: None, the checkpoint's own format; ``fp8``,
    ``int8``, ``int4``, ``fp8_dequant``; docs/checkpoints.md);
    ``attention_backend``: ``torch`` | ``triton`` (default: triton on cuda, torch on cpu);
    ``enforce_eager`` (or ``cuda_graphs=False``): no CUDA graphs for decode steps (cuda with
    triton only replays them). KV pool: ``num_blocks``, else enough for ``max_num_seqs`` x
    ``max_model_len`` within ``kv_cache_memory_gib``, or on cuda within
    ``gpu_memory_utilization`` of the free GPU memory less the weights. ``host_kv_gib`` /
    ``kv_store_dir``: the prefix cache's second tier (docs/kv_cache.md). ``cpu_threads``: torch
    threads of this process (default: the launcher's rule, this process's share of the cores, 1
    for a model with hidden_size < 512).

    ``deploy``: a preset of conf/deploy (``"single"``, ``"a1e2"``, ``"p1a1e2"``,
    ``"colocated2"``, ``"auto"``) or a mapping of ``deploy.*`` keys; ``tensor_parallel_size``:
    attention TP; ``world_size``: the ranks (default: what the plan needs, else 1);
    ``overrides``: any launcher key as ``"group.key=value"``. All of it goes through the
    launcher's resolution (``megainfer.engine.resolve``). Bad settings raise ``ConfigError``
    naming the argument (and its config key) before any weight is loaded.

    Every mode runs (docs/python_api.md). Under ``mpiexec -n N python script.py`` every rank
    runs the script: ``LLM(...)`` returns on rank 0 only; on every other rank it serves inside
    the call until rank 0 closes the LLM (``close()``, a ``with`` block, garbage collection or
    interpreter exit), then ends that process with status 0, so the code after ``LLM(...)``
    runs once. From a plain ``python script.py``, a mode with several ranks starts them as an
    ``mpiexec`` child job and ends them the same ways (also when the script raises or gets
    SIGINT/SIGTERM). A rank that dies or hangs raises ``RankLostError`` (naming it) within
    ``comm.timeout_s``. Re-planning (``replan.enabled``) switches ranks between the engine
    core's iterations (docs/replan.md, "Online").
    """

    _engine_process = False  # single mode's core in a child job too (AsyncLLM(engine_process=True))

    def __init__(self, model: Union[str, ModelConfig], *, tokenizer: Optional[Tokenizer] = None,
                 revision: Optional[str] = None, trust_remote_code: bool = False,
                 load_format: str = "auto", dtype: Optional[str] = None,
                 quantization: Optional[str] = None,
                 device: Optional[str] = None, attention_backend: Optional[str] = None,
                 cuda_graphs: bool = True, enforce_eager: bool = False, seed: int = 0,
                 max_model_len: Optional[int] = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, enable_chunked_prefill: bool = True,
                 block_size: int = 16, num_blocks: Optional[int] = None,
                 kv_cache_memory_gib: float = 4.0, gpu_memory_utilization: Optional[float] = None,
                 enable_prefix_caching: Optional[bool] = None, kv_cache_dtype: str = "auto",
                 host_kv_gib: float = 0.0, kv_store_dir: Optional[str] = None,
                 kv_scale_granularity: str = DEFAULT_KV_SCALE_GRANULARITY,
                 tensor_parallel_size: Optional[int] = None, cpu_threads: Optional[int] = None,
                 deploy: Union[None, str, Mapping] = None, world_size: Optional[int] = None,
                 overrides: Sequence[str] = ()):
        if trust_remote_code:
            raise ConfigError("LLM(trust_remote_code=True): refused: megainfer runs only its own "
                              "model code (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3 families), never "
                              "code shipped with a checkpoint")
        if not isinstance(model, (str, ModelConfig)):
            raise ConfigError(f"LLM(model={model!r}): give a checkpoint directory, a Hugging Face "
                              "model id (org/name) or a ModelConfig")
        args = dict(model=model if isinstance(model, str) else None, revision=revision,
                    load_format=load_format, dtype=dtype, quantization=quantization,
                    device=device,
                    attention_backend=attention_backend,
                    cuda_graphs=None if cuda_graphs and not enforce_eager else False, seed=seed,
                    max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens,
                    enable_chunked_prefill=enable_chunked_prefill, block_size=block_size,
                    num_blocks=num_blocks, kv_cache_memory_gib=kv_cache_memory_gib,
                    gpu_memory_utilization=gpu_memory_utilization,
                    enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype,
                    host_kv_gib=host_kv_gib, kv_store_dir=kv_store_dir,
                    kv_scale_granularity=kv_scale_granularity,
                    tensor_parallel_size=tensor_parallel_size, cpu_threads=cpu_threads)
        self._setup(resolve_llm_job(args, model, deploy, tensor_parallel_size, world_size,
                                    overrides, enforce_eager, self._engine_process,
                                    launch=mpi_world()), tokenizer)

    @classmethod
    def from_job(cls, job: ResolvedJob, tokenizer: Optional[Tokenizer] = None) -> "LLM":
        """From an already-resolved single-mode job (the launcher's path)."""
        self = cls.__new__(cls)
        self._setup(LLMJob(None, job), tokenizer)
        return self

    def _setup(self, resolved: "LLMJob", tokenizer) -> None:
        job = resolved.job
        self.job, self.model_config, self.load_config = job, job.model, job.load
        self.scheduler_config, self.cache_config = job.scheduler, job.cache
        self.device_config = job.device
        self._counter = 0
        # the one route: this client -> the engine core -> the engine (docs/architecture.md)
        self._client = open_sync(resolved.spec, job, tokenizer)
        self._finalizer = weakref.finalize(self, self._client.close, SHUTDOWN_TIMEOUT_S)
        # the engine when it is in this process: single mode's LLMEngine (its model too), rank
        # 0's RuntimeEngine under mpiexec; None when the ranks are a child job
        self.engine = self._client.engine
        self.model = self.engine.executor.model if job.deploy.mode == "single" else None
        if job.deploy.mode != "single":
            log.info("[attn dp0 tp0] %s mode over %d ranks (%s)", job.deploy.mode,
                     job.deploy.world_size, job.deploy)

    def close(self) -> None:
        """End the engine core (and the runtime's ranks). Also at garbage collection and at
        interpreter exit."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer:
        return self._client.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in input order. Every prompt is validated before any work starts: a bad one
        raises its ``RequestError`` and nothing runs."""
        inputs = self._inputs(prompts, sampling_params)
        with _Progress(len(inputs), use_tqdm, self._client) as bar:
            done = self._client.generate(inputs, bar.update)
        return [done[str(inp.request_id)] for inp in inputs]

    def chat(self, messages: Union[Sequence[dict], Sequence[Sequence[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: Optional[str] = None, tools: Optional[Sequence[dict]] = None,
             chat_template_kwargs: Optional[Mapping] = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``) or a list of
        them, rendered with the checkpoint's chat template (``chat_template.jinja`` or
        ``tokenizer_config.json``'s ``chat_template``) or the ``chat_template`` given, in a
        sandbox; the rendered text is tokenized without adding special tokens again. No template,
        or one that fails, raises ``ChatTemplateError`` (a ``ValueError``) before any work.
        ``tools`` (OpenAI's function definitions) and ``chat_template_kwargs`` are passed to the
        template as its variables."""
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        renderer = ChatRenderer(self.load_config.path, chat_template)
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = list(tools)
        texts = [renderer.render(c, add_generation_prompt, **extra) for c in convs]
        tok = self.get_tokenizer()
        outs = self.generate([{"prompt_token_ids": encode_chat(tok, t)} for t in texts],
                             sampling_params, use_tqdm)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def generate_stream(self, requests: Iterable[PromptInput],
                        use_tqdm: bool = False, total: Optional[int] = None) -> Iterator[RequestOutput]:
        """Each output as soon as its request finishes; an invalid request is at once a failed
        output (finish_reason "error") naming the culprit, and the others run (the launcher's
        offline job)."""
        with _Progress(total, use_tqdm, self._client) as bar:
            for out in self._client.generate_stream(requests):
                bar.update(out)
                yield out

    def _inputs(self, prompts, params) -> list[PromptInput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                 and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise RequestError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        out = []
        for p, sp in zip(prompts, params):
            out.append(PromptInput.of(f"{self._counter}", p, sp))
            self._counter += 1
        return out


class _Progress:
    """A tqdm bar over finished requests showing output tokens/s (no-op when disabled)."""

    def __init__(self, total: Optional[int], enabled: bool, client):
        self.bar, self.client = None, client
        if enabled:
            self.bar = tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
        self.tokens0 = client.num_generated_tokens

    def update(self, out: RequestOutput) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        tok = self.client.num_generated_tokens - self.tokens0
        self.bar.set_postfix_str(f"output {tok / elapsed:.1f} tok/s", refresh=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


__all__ = ["LLM", "SamplingParams", "RequestOutput", "PromptInput"]
