"""``deploy=auto`` over N > 1 ranks: the composed config tree -> the plan the performance model
picks.

The job as the planner sees it (model shape from config.json or preset, prompt lengths from
``io.input`` or the workload, ``sampling.max_tokens``, ``scheduler.max_num_seqs``) and this
machine's hardware profile -> the fastest split of exactly N ranks (``world_plan.py``), logged
with the runner-up; with ``slo.arrival_rate`` set, a server's plan (``serving_plan.py``),
the decode-attention offload included when ``pd.offload`` is unset.
Explicit ``deploy.*`` counts pin their dimension. Hardware: ``deploy.hardware``, else the
calibrated profile, else on cuda the datasheet preset in the GPU's name (the one place the
perfmodel asks torch, lazily), else ``cpu_node``. Pure arithmetic: every rank plans alike.
docs/perfmodel.md, "The planner at launch".
"""
from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import asdict, replace

from megainfer.config import ConfigError, ModelConfig, SchedulerConfig
from megainfer.config.deploy_fit import prefill_ranks
from megainfer.config.model_source import model_config_of
from megainfer.perfmodel.model.weight_format import with_weight_format

log = logging.getLogger("megainfer.perfmodel")

FALLBACK_PROFILE = "cpu_node"
COUNT_KEYS = ("attention_replicas", "attention_tp", "expert_ranks", "micro_batches")
PREFILL_KEYS = ("prefill_replicas", "prefill_tp")  # chosen too when planning for serving
MAX_LINES = 100_000  # prompt lengths are estimated from at most this many input lines


def machine_profile_path() -> str:
    return os.environ.get("MEGAINFER_HARDWARE_PROFILE") or os.path.join(
        os.path.expanduser("~"), ".cache", "megainfer", "hardware", f"{socket.gethostname()}.yaml")


def _gpu_preset(device) -> str | None:
    """The conf/hardware datasheet preset named in this machine's GPU name (deploy.device=cuda)."""
    if device != "cuda":
        return None
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        gpu = torch.cuda.get_device_name(0).lower().replace("-", "").replace(" ", "")
    except Exception:  # no usable CUDA: the CPU fallback below
        return None
    from megainfer.perfmodel.model.hardware import known_hardware
    hits = [n for n in known_hardware() if n.split("_")[0] in gpu]
    return max(hits, key=len) if hits else None


def hardware_for(name, device=None) -> tuple:
    """(HardwareProfile, where it came from: a few words)."""
    from megainfer.perfmodel.model.hardware import load_hardware
    if name:
        return load_hardware(str(name)), f"deploy.hardware={name}"
    path = machine_profile_path()
    if os.path.isfile(path):
        return load_hardware(path), f"calibrated, {path}"
    gpu = _gpu_preset(device)
    preset = gpu or FALLBACK_PROFILE
    return load_hardware(preset), "GPU datasheet preset" if gpu else "preset"


def calibrate_hint() -> str:
    """The one line saying how to calibrate this machine (logged when it is not)."""
    return f"[plan] not calibrated: megainfer-plan calibrate calibrate.out={machine_profile_path()}"


def model_shape(cfg: ModelConfig, name: str = "model"):
    """ModelConfig -> ModelShape, MLA included: DeepSeek's attention is counted by its
    parameters and its cache by the latent (kv_lora_rank + qk_rope_head_dim per token and
    layer), its shared experts as n_shared_experts x moe_intermediate_size, as the
    conf/plan_model/deepseek_v3.yaml preset does."""
    from megainfer.perfmodel.model.shapes import ModelShape
    shape = ModelShape.from_model_config(cfg, name)
    if not cfg.is_mla:
        return shape
    h, n = cfg.hidden_size, cfg.num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = h * n * qk if cfg.q_lora_rank is None else h * cfg.q_lora_rank + cfg.q_lora_rank * n * qk
    attn = (q + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # q, kv_a
            + cfg.kv_lora_rank * n * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # kv_b
            + n * cfg.v_head_dim * h)  # o
    return replace(shape, num_kv_heads=n, head_dim=qk, attn_params_override=attn,
                   attn_unquantised_params=cfg.kv_lora_rank * n * (cfg.qk_nope_head_dim
                                                                   + cfg.v_head_dim),  # kv_b
                   kv_elems_override=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                   shared_intermediate_size=(shape.shared_intermediate_size
                                             or cfg.n_shared_experts * cfg.moe_intermediate_size))


def shape_of(cfg: ModelConfig, hw):
    """ModelShape; named after a plan_model preset with the same numbers when the profile has a
    calibrated fit under that name (so the fit, not the roofline, times it)."""
    import yaml
    from megainfer.perfmodel.model.hardware import hardware_dir
    from megainfer.perfmodel.model.shapes import ModelShape
    shape = model_shape(cfg, "model")
    mine = {k: v for k, v in asdict(shape).items() if k not in ("name", "source")}
    presets = os.path.join(os.path.dirname(hardware_dir()), "plan_model")
    for name in sorted(hw.fits):
        p = os.path.join(presets, f"{name}.yaml")
        if not os.path.isfile(p):
            continue
        with open(p) as f:
            d = yaml.safe_load(f) or {}
        d.pop("name", None)
        try:
            other = ModelShape.from_dict(d, name)
        except ConfigError:
            continue
        if {k: v for k, v in asdict(other).items() if k not in ("name", "source")} == mine:
            return replace(shape, name=name)
    return shape


def _text_tokens(s: str) -> int:
    return max(1, len(s.encode()) // 4)  # ~4 bytes a token: an estimate, logged as one


def _line_tokens(line: str, path: str) -> int | None:
    if path.endswith(".txt"):
        return _text_tokens(line) if line.strip() else None
    try:
        d = json.loads(line)
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    if isinstance(d.get("prompt_token_ids"), list):
        return max(1, len(d["prompt_token_ids"]))
    if isinstance(d.get("prompt"), str):
        return _text_tokens(d["prompt"])
    if isinstance(d.get("messages"), list):
        return _text_tokens(" ".join(str(x.get("content", "")) for x in d["messages"]
                                     if isinstance(x, dict)))
    return None


def prompt_lengths(c: dict) -> tuple[list, str]:
    """Prompt lengths in tokens (estimated for text) and where they came from."""
    path = (c.get("io") or {}).get("input")
    if path:
        lens = []
        try:
            with open(os.path.expanduser(str(path)), encoding="utf-8", errors="replace") as f:
                for i, line in enumerate(f):
                    if i >= MAX_LINES:
                        break
                    n = _line_tokens(line, str(path))
                    if n is not None:
                        lens.append(n)
        except OSError:
            pass  # job_requests reports an unreadable input with its own error
        return lens, f"io.input={path}"
    w = c.get("workload") or {}
    if w.get("kind") == "random":
        return [int(w.get("input_len") or 1)] * max(1, int(w.get("num_prompts") or 1)), "workload"
    return [_text_tokens(p) for p in (w.get("prompts") or [])], "workload prompts"


def auto_plan(c: dict, world: int) -> tuple[dict, dict, dict]:
    """(``deploy``, ``scheduler``, ``pd``) dicts to resolve. ``deploy``: with ``deploy.mode=auto`` and
    world > 1, the planner's choice filled into the counts the user left null: for serving
    (``slo.arrival_rate`` set) AE or PD over the whole world (``serving_plan``), else the
    fastest decode split of the ranks the prefill ranks leave; otherwise ``deploy`` unchanged.
    ``scheduler``: the scheduler section with ``max_num_seqs`` lowered to the chosen plan's
    batch limit per replica when the KV memory of the profile (or, serving, the TPOT SLO) is
    what bounds that batch (the requests and ``max_num_seqs`` bounds are already the runtime's
    own); otherwise both unchanged. ``pd``: the ``pd`` group; planning a server with
    ``pd.offload`` unset, ``offload=true`` and the chosen ``offload_ratio`` when the plan
    chosen offloads decode attention; otherwise unchanged."""
    sched = dict(c.get("scheduler") or {})
    d = dict(c.get("deploy") or {})
    pd = dict(c.get("pd") or {})
    hw_name = d.pop("hardware", None)
    if d.get("mode", "auto") not in (None, "auto") or world < 2:
        return d, sched, pd
    serving = (c.get("slo") or {}).get("arrival_rate") is not None
    keys = COUNT_KEYS + PREFILL_KEYS if serving else COUNT_KEYS
    pins = {k: d.get(k) for k in keys}
    if all(v is not None for v in pins.values()):
        return d, sched, pd
    if any(v is not None and (not isinstance(v, int) or isinstance(v, bool)
                              or v < (0 if k == "prefill_replicas" else 1))
           for k, v in pins.items()):
        return d, sched, pd  # DeployPlan names the bad value
    if serving:
        from .serving_plan import serving_plan
        return serving_plan(c, d, hw_name, pins, world, sched)
    best = _ranked(c, d, hw_name, pins, world - prefill_ranks(d))
    if best is None:
        return d, sched, pd
    p = best.plan
    if best.binding == "kv_memory" and best.batch_limit < _max_seqs(sched):
        log.info("[plan] batch limit applied: scheduler.max_num_seqs %d -> %d per replica (the "
                 "KV memory of the profile bounds the plan's batch)", _max_seqs(sched),
                 best.batch_limit)
        sched["max_num_seqs"] = best.batch_limit
    return dict(d, mode="disaggregated", attention_replicas=p.n_a, attention_tp=p.tp_a,
                expert_ranks=p.n_e, micro_batches=p.m), sched, pd


def job_shape(c: dict, hw):
    """The job's model as the planner's ModelShape, its weights in ``model.quantization``'s
    format (null: the checkpoint's own) and its KV in the cache's."""
    m = c.get("model") or {}
    shape = with_weight_format(shape_of(model_config_of(m), hw), m.get("quantization"),
                               int(m.get("quantization_group_size") or 64), m.get("path"))
    cache = c.get("cache") or {}
    kv_dtype = cache.get("kv_cache_dtype")
    if kv_dtype not in (None, "auto"):  # the KV-memory bound follows the cache format
        shape = replace(shape, kv_cache_dtype=kv_dtype,
                        kv_scale_granularity=cache.get("kv_scale_granularity", "token_head"))
    return shape


def plan_dtype(c: dict, d: dict, hw) -> str:
    """``model.dtype`` (auto: bfloat16 on cuda, float32 on cpu), else one the profile times."""
    dtype = (c.get("model") or {}).get("dtype")
    if dtype in (None, "auto"):
        dtype = "bfloat16" if d.get("device") == "cuda" else "float32"
    return dtype if dtype in hw.matmul_flops else (
        "float32" if "float32" in hw.matmul_flops else sorted(hw.matmul_flops)[0])


def _max_seqs(sched: dict) -> int:
    return int(sched.get("max_num_seqs") or SchedulerConfig.max_num_seqs)


def _ranked(c: dict, d: dict, hw_name, pins: dict, world: int):
    """The planner's best WorldChoice for this job (logged with its runner-up), or None when
    no split fits (deploy.py then infers the counts and names a fix)."""
    from megainfer.perfmodel.model.disagg import Workload
    from megainfer.perfmodel.plan.world_plan import JobLoad, NoWorldPlanError, Pins, plan_world
    hw, hw_from = hardware_for(hw_name, d.get("device"))
    shape = job_shape(c, hw)
    lens, src = prompt_lengths(c)
    samp, sched = c.get("sampling") or {}, c.get("scheduler") or {}
    wl = Workload(max(1, round(sum(lens) / len(lens))) if lens else 16,
                  max(1, int(samp.get("max_tokens") or 16)))
    n_seqs = max(1, len(lens)) * max(1, int(samp.get("n") or 1))
    job = JobLoad(n_seqs, _max_seqs(sched), wl)
    dtype = plan_dtype(c, d, hw)
    try:
        ranked = plan_world(shape, hw, job, world, Pins(**pins), dtype)
    except NoWorldPlanError as e:  # deploy.py then fills the counts or names a fix
        log.info("[plan] %s; the counts are inferred from the world size instead", e)
        return None
    best = ranked[0]
    timing = "calibrated fit" if shape.name in hw.fits else "roofline"
    log.info("[plan] deploy=auto over %d ranks: hardware %s (%s); %s timed by %s, weights in "
             "%s (%.4g MiB); job %d sequences, prompt ~%d tokens (%s), max_tokens %d", world,
             hw.name, hw_from, shape.name, timing, shape.quantization or dtype,
             shape.total_weight_bytes(dtype) / 2**20, n_seqs, wl.input_len, src, wl.output_len)
    if "preset" in hw_from:
        log.info(calibrate_hint())
    log.info("[plan] chosen: %s", best.describe())
    if len(ranked) > 1:
        r = ranked[1]
        log.info("[plan] runner-up: %s (predicted %.1f%% slower)", r.describe(),
                 100 * (best.pred.tokens_per_s / r.pred.tokens_per_s - 1))
    return best
