"""The offline Python API (vLLM-shaped): ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import logging
from typing import Iterable, Iterator, Mapping, Optional, Sequence, Union


from megainfer.config import CacheConfig, DeviceConfig, LoadConfig, ModelConfig, SchedulerConfig
from megainfer.config.runtime import DEFAULT_KV_SCALE_GRANULARITY
from megainfer.engine import (LLMEngine, PromptInput, RequestError, RequestOutput, SamplingParams,
                              check_cache_fits)
from megainfer.engine.sizing import (check_kv_cache_dtype, derive_num_blocks,
                                     resolve_max_model_len)
from megainfer.engine.tokenizer import Tokenizer, load_tokenizer
from megainfer.models.loader import DTYPES, build_model

Prompt = Union[str, Sequence[int], dict]
log = logging.getLogger("megainfer.engine")


def _device_name(device: DeviceConfig) -> str:
    if device.device != "cuda":
        return "cpu"
    import torch
    return f"cuda:{device.index} ({torch.cuda.get_device_name(device.index)})"


class LLM:
    """Single mode: one process, the whole model local.

    ``model``: an HF checkpoint directory, or a ``ModelConfig`` (then ``load_format`` is dummy:
    seeded random weights, drawn straight onto the device). ``seed`` seeds the sampling of
    requests without their own seed. ``device``: ``cpu`` | ``cuda`` (default: cuda when one is
    visible); ``dtype``: ``float32`` | ``bfloat16`` | ``float16`` (default: bfloat16 on cuda,
    float32 on cpu); ``attention_backend``: ``torch`` | ``triton`` (default: triton on cuda,
    torch on cpu); ``cuda_graphs``: decode steps replay CUDA graphs (cuda with triton only).
    ``host_kv_gib`` / ``kv_store_dir``: the prefix cache's second tier (docs/kv_cache.md).
    Bad settings raise ``ConfigError`` naming the key before any weight is loaded.
    """

    def __init__(self, model: Union[str, ModelConfig], *, load_format: str = "auto",
                 dtype: Optional[str] = None, device: Optional[str] = None,
                 attention_backend: Optional[str] = None, cuda_graphs: bool = True,
                 seed: int = 0, max_model_len: Optional[int] = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 enable_chunked_prefill: bool = True, block_size: int = 16,
                 num_blocks: Optional[int] = None, kv_cache_memory_gib: float = 4.0,
                 enable_prefix_caching: Optional[bool] = None, kv_cache_dtype: str = "auto",
                 host_kv_gib: float = 0.0, kv_store_dir: Optional[str] = None,
                 kv_scale_granularity: str = DEFAULT_KV_SCALE_GRANULARITY,
                 tokenizer: Optional[Tokenizer] = None):
        path = model if isinstance(model, str) else None
        model_config = ModelConfig.from_pretrained(path) if path else model
        if load_format == "auto":
            load_format = "safetensors" if path else "dummy"
        dev = DeviceConfig.resolve(device, attention_backend, cuda_graphs)
        dtype = dtype or dev.default_dtype()
        dev.check_model(model_config, dtype)
        load = LoadConfig(path=path, load_format=load_format, dtype=dtype, seed=seed)
        mml = resolve_max_model_len(model_config, max_model_len)
        scheduler = SchedulerConfig(max_num_seqs, max_num_batched_tokens, mml, enable_chunked_prefill)
        check_kv_cache_dtype(model_config, kv_cache_dtype, dev.attention_backend)
        if num_blocks is None:
            num_blocks = derive_num_blocks(model_config, mml, max_num_seqs, block_size,
                                           kv_cache_memory_gib, DTYPES[dtype],
                                           kv_cache_dtype=kv_cache_dtype,
                                           kv_scale_granularity=kv_scale_granularity)
        prefix = CacheConfig.enable_prefix_caching if enable_prefix_caching is None \
            else enable_prefix_caching
        cache = CacheConfig(block_size, num_blocks, prefix, kv_cache_dtype, host_kv_gib, kv_store_dir,
                            kv_scale_granularity)
        self._build(model_config, load, scheduler, cache, dev, tokenizer, seed)

    @classmethod
    def from_configs(cls, model_config: ModelConfig, load: LoadConfig, scheduler: SchedulerConfig,
                     cache: CacheConfig, tokenizer: Optional[Tokenizer] = None, seed: int = 0,
                     device: DeviceConfig = DeviceConfig()) -> "LLM":
        """From already-resolved config objects (the Hydra launcher's path)."""
        self = cls.__new__(cls)
        device.check_model(model_config, load.dtype)
        check_kv_cache_dtype(model_config, cache.kv_cache_dtype, device.attention_backend)
        self._build(model_config, load, scheduler, cache, device, tokenizer, seed)
        return self

    def _build(self, model_config, load, scheduler, cache, device: DeviceConfig, tokenizer, seed):
        self.model_config, self.load_config = model_config, load
        self.scheduler_config, self.cache_config, self.device_config = scheduler, cache, device
        check_cache_fits(cache, scheduler.max_model_len)
        if device.device == "cuda":
            import torch
            torch.cuda.set_device(device.index)  # Triton launches on the current device
        self.model = build_model(model_config, load, device=device.torch_device)
        self.model.set_attention_backend(device.attention_backend)
        log.info("[attn dp0 tp0] %s on %s (%s), %s weights, attention %s%s", model_config.family,
                 _device_name(device), load.dtype, load.load_format, device.attention_backend,
                 ", CUDA graphs for decode" if device.cuda_graphs else "")
        self.engine = LLMEngine.from_model(
            self.model, scheduler, cache,
            tokenizer or load_tokenizer(load.path, model_config.eos_token_id), seed=seed,
            cuda_graphs=device.cuda_graphs)
        self._counter = 0

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in input order. Every prompt is validated before any work starts: a bad one
        raises its ``RequestError`` and nothing runs."""
        inputs = self._inputs(prompts, sampling_params)
        added = []
        try:
            for inp in inputs:
                self.engine.add_request(inp.request_id, inp.prompt, inp.params,
                                        prompt_token_ids=inp.prompt_token_ids)
                added.append(inp.request_id)
        except RequestError:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        done = {}
        with _Progress(len(inputs), use_tqdm, self.engine) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    done[out.request_id] = out
                    bar.update(out)
        return [done[inp.request_id] for inp in inputs]

    def chat(self, messages: Union[Sequence[dict], Sequence[Sequence[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: Optional[str] = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``) or a list of
        them, rendered with the checkpoint's chat template (``chat_template.jinja`` or
        ``tokenizer_config.json``'s ``chat_template``) or the ``chat_template`` given, in a
        sandbox; the rendered text is tokenized without adding special tokens again. No template,
        or one that fails, raises ``ChatTemplateError`` (a ``ValueError``) before any work."""
        from megainfer.engine.chat_template import ChatRenderer, encode_chat
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        renderer = ChatRenderer(self.load_config.path, chat_template)
        texts = [renderer.render(c, add_generation_prompt) for c in convs]
        tok = self.engine.tokenizer
        outs = self.generate([{"prompt_token_ids": encode_chat(tok, t)} for t in texts],
                             sampling_params, use_tqdm)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def generate_stream(self, requests: Iterable[PromptInput],
                        use_tqdm: bool = False, total: Optional[int] = None) -> Iterator[RequestOutput]:
        """Each output as soon as its request finishes (invalid ones at once, as errors)."""
        with _Progress(total, use_tqdm, self.engine) as bar:
            for out in self.engine.generate_stream(requests):
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

    def __init__(self, total: Optional[int], enabled: bool, engine: LLMEngine):
        self.bar, self.engine = None, engine
        if enabled:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
        self.tokens0 = engine.num_generated_tokens

    def update(self, out: RequestOutput) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        elapsed = self.bar.format_dict["elapsed"] or 1e-9
        tok = self.engine.num_generated_tokens - self.tokens0
        self.bar.set_postfix_str(f"output {tok / elapsed:.1f} tok/s", refresh=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


__all__ = ["LLM", "SamplingParams", "RequestOutput", "PromptInput"]
