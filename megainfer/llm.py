"""The offline Python API (vLLM-shaped): ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import logging
from typing import Iterable, Iterator, Mapping, Optional, Sequence, Union

from megainfer.config import ConfigError, ResolvedJob, ModelConfig
from megainfer.config.llm_args import (DeployNotAvailableError, launcher_command, llm_tree,
                                       named_error)
from megainfer.engine.resolve import resolve_job
from megainfer.config.runtime import DEFAULT_KV_SCALE_GRANULARITY, DeviceConfig
from megainfer.engine import LLMEngine, PromptInput, RequestError, RequestOutput, SamplingParams
from megainfer.engine.tokenizer import Tokenizer, load_tokenizer
from megainfer.models.loader import build_model

Prompt = Union[str, Sequence[int], dict]
log = logging.getLogger("megainfer.engine")


def _device_name(device: DeviceConfig) -> str:
    if device.device != "cuda":
        return "cpu"
    import torch
    return f"cuda:{device.index} ({torch.cuda.get_device_name(device.index)})"


class LLM:
    """One model, vLLM's constructor names where they mean the same thing.

    ``model``: a checkpoint directory, a Hugging Face model id (``"org/name"``, read from the
    local HF cache at ``revision``; nothing is downloaded), or a ``ModelConfig`` (then
    ``load_format`` is dummy: seeded random weights drawn straight onto the device).
    ``trust_remote_code=True`` is refused: megainfer runs its own model code only.
    ``seed`` seeds the sampling of requests without their own seed (and dummy weights).
    ``device``: ``cpu`` | ``cuda`` (default: cuda when one is visible); ``dtype``: ``float32`` |
    ``bfloat16`` | ``float16`` (default: bfloat16 on cuda, float32 on cpu);
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
    launcher's resolution (``megainfer.engine.resolve``). Only single mode runs from Python
    yet: any other mode is resolved and validated, then ``DeployNotAvailableError`` names the
    ``mpirun -n N megainfer-launch ...`` line that runs it. Bad settings raise ``ConfigError``
    naming the argument (and its config key) before any weight is loaded.
    """

    def __init__(self, model: Union[str, ModelConfig], *, tokenizer: Optional[Tokenizer] = None,
                 revision: Optional[str] = None, trust_remote_code: bool = False,
                 load_format: str = "auto", dtype: Optional[str] = None,
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
                    load_format=load_format, dtype=dtype, device=device,
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
        world = None if world_size is None else f"world_size={world_size!r}"
        origin: dict = {}
        try:
            tree, origin = llm_tree(args, "single" if deploy is None and tensor_parallel_size
                                    in (None, 1) and world_size in (None, 1) else deploy,
                                    overrides)
            if enforce_eager:
                origin["engine.cuda_graphs"] = "enforce_eager=True"
            if isinstance(model, ModelConfig):
                tree.setdefault("model", {})["arch"] = model
            job = resolve_job(tree, _world_size(world_size, tree), planner=_planner(tree))
        except ConfigError as e:
            named = named_error(e, origin, world)
            if named is e:
                raise
            raise named from e
        if job.deploy.mode != "single":
            asked = ", ".join(f"{k}={v!r}" for k, v in (
                ("deploy", deploy), ("tensor_parallel_size", tensor_parallel_size),
                ("world_size", world_size)) if v is not None)
            raise DeployNotAvailableError(
                f"LLM({asked}): {job.deploy.mode} mode over {job.deploy.world_size} "
                f"ranks ({job.deploy}) resolves and is valid, but is not yet available from "
                "Python: LLM runs single mode only for now. Run it with the launcher: "
                f"`{launcher_command(deploy, job.deploy, args['model'], overrides)}`")
        self._build(job, tokenizer)

    @classmethod
    def from_job(cls, job: ResolvedJob, tokenizer: Optional[Tokenizer] = None) -> "LLM":
        """From an already-resolved single-mode job (the launcher's path)."""
        self = cls.__new__(cls)
        self._build(job, tokenizer)
        return self

    def _build(self, job: ResolvedJob, tokenizer):
        import torch
        self.job, self.model_config, self.load_config = job, job.model, job.load
        self.scheduler_config, self.cache_config = job.scheduler, job.cache
        device = self.device_config = job.device
        if job.cpu_threads is not None:
            torch.set_num_threads(job.cpu_threads)
        if device.device == "cuda":
            torch.cuda.set_device(device.index)  # Triton launches on the current device
        self.model = build_model(job.model, job.load, device=device.torch_device)
        self.model.set_attention_backend(device.attention_backend)
        log.info("[attn dp0 tp0] %s on %s (%s), %s weights, attention %s%s, %d cpu threads",
                 job.model.family, _device_name(device), job.load.dtype, job.load.load_format,
                 device.attention_backend, ", CUDA graphs for decode" if device.cuda_graphs else "",
                 torch.get_num_threads())
        self.engine = LLMEngine.from_model(
            self.model, job.scheduler, job.cache,
            tokenizer or load_tokenizer(job.load.path, job.model.eos_token_id), seed=job.seed,
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


def _world_size(world_size: Optional[int], tree: dict) -> int:
    """``world_size``, else what the deploy plan's counts need (a preset with every count), else 1."""
    if world_size is not None:
        return world_size
    d = tree.get("deploy") or {}
    if d.get("mode") == "colocated" and isinstance(d.get("attention_replicas"), int):
        return d["attention_replicas"]
    counts = [d.get(k) for k in ("attention_replicas", "attention_tp", "expert_ranks")]
    if d.get("mode") == "disaggregated" and all(isinstance(v, int) for v in counts):
        pre = d.get("prefill_replicas") or 0
        return counts[0] * counts[1] + counts[2] + pre * (d.get("prefill_tp") or 1)
    return 1


def _planner(tree: dict):
    """deploy=auto over N > 1 ranks: the launcher's planner (the performance model)."""
    if (tree.get("deploy") or {}).get("mode", "auto") not in (None, "auto"):
        return None
    from megainfer.perfmodel.plan.auto_plan import auto_plan
    return auto_plan


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
