"""What megainfer-plan does, as library calls: search, print, simulate the chosen plan, draw it."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from megainfer.config import ConfigError
from megainfer.perfmodel.model.disagg import DisaggModel, Workload
from megainfer.perfmodel.model.hardware import HardwareProfile
from megainfer.perfmodel.model.layer_times import layer_times_for
from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.perfmodel.model.colocated import ColocatedModel
from megainfer.perfmodel.plan.planner import (GiB, ModelTooLargeError, PlanError, SearchSpace,
                                              plan_colocated, plan_disaggregated)
from megainfer.perfmodel.plan.report import as_dict, memory_line, table, weights_line
from megainfer.perfmodel.sim.fixed_batch import simulate_plan
from megainfer.perfmodel.timeline_plot import plot_trace
from megainfer.perfmodel.trace import read_trace


@dataclass(frozen=True)
class PlanOptions:
    dtype: str = "bfloat16"
    heterogeneous: bool = True
    use_fit: bool = True
    colocated: bool = True
    top: int = 10
    out_dir: str = "plan_out"
    timeline: bool = True
    timeline_layers: int = 3
    jitter_s: float = 0.0
    routing: str = "balanced"
    skew: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.top < 1:
            raise ConfigError(f"top={self.top!r}: must be >= 1")


def _format_hint(shape: ModelShape, hw: HardwareProfile, dtype: str) -> str:
    """The weights' size in this format and in the smaller ones the device runs (int4: CPU
    profiles only, as the runtime refuses it on cuda): a too-large model's error."""
    mine = shape.total_weight_bytes(dtype)
    parts = [f"weights in {shape.quantization or dtype}: {mine / GiB:.4g} GiB in all"]
    for q in ("fp8", "int8") + (("int4",) if hw.node.cores > 0 else ()):
        b = replace(shape, quantization=q).total_weight_bytes(dtype)
        if b < 0.9 * mine:
            parts.append(f"model.quantization={q}: {b / GiB:.4g} GiB")
    return "; ".join(parts)


def _colocated_memory(shape, hw, workload, opt, ranked, echo) -> None:
    pred = ranked.pred
    model = ColocatedModel(shape, layer_times_for(hw, shape, opt.dtype, opt.use_fit), workload,
                           opt.dtype)
    w = model.mem(replace(pred.plan, batch=0))
    per_seq = model.mem(replace(pred.plan, batch=1)) - w
    echo(memory_line(f"colocated ({pred.plan.label()})", w, pred.mem, hw.mem_bytes * hw.mem_util,
                     per_seq, workload.kv_len))


def _colocated_only(shape, profiles, workload, space, opt, err: PlanError, echo) -> dict:
    """No disaggregated plan fits the devices: the colocated plan when it does, else one error
    naming both and the weights in each smaller format."""
    try:
        col = plan_colocated(shape, profiles[0], workload, space, opt.dtype, opt.use_fit)
    except PlanError as e:
        raise ModelTooLargeError(f"{err}; colocated: {e} ({_format_hint(shape, profiles[0], opt.dtype)})") from None
    echo(f"[plan] no disaggregated plan: {err}")
    echo(f"[plan] best colocated plan on {profiles[0].name}")
    echo(table(col, opt.top))
    _colocated_memory(shape, profiles[0], workload, opt, col[0], echo)
    result = {"model": shape.name, "plans": [], "colocated": as_dict(col[0])}
    os.makedirs(opt.out_dir, exist_ok=True)
    with open(os.path.join(opt.out_dir, "plans.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def run_plan(shape: ModelShape, profiles: list[HardwareProfile], workload: Workload,
             space: SearchSpace, opt: PlanOptions, echo=print) -> dict:
    kind = layer_times_for(profiles[0], shape, opt.dtype, opt.use_fit).kind
    echo(f"[plan] model={shape.name} hardware={'/'.join(p.name for p in profiles)} "
         f"T_a/T_e from {kind}, TPOT SLO {space.tpot_slo_s * 1e3:g} ms, "
         f"workload in={workload.input_len} out={workload.output_len}")
    echo(weights_line(shape, opt.dtype))
    try:
        ranked = plan_disaggregated(shape, profiles, workload, space, opt.dtype,
                                    opt.heterogeneous, opt.use_fit)
    except ModelTooLargeError as e:
        if not opt.colocated:
            raise ModelTooLargeError(f"{e} ({_format_hint(shape, profiles[0], opt.dtype)})") from None
        return _colocated_only(shape, profiles, workload, space, opt, e, echo)
    best = ranked[0].pred
    echo(table(ranked, opt.top))
    plan = best.plan
    hw = {p.name: p for p in profiles}
    model = DisaggModel(shape, layer_times_for(hw[plan.hw_a], shape, opt.dtype, opt.use_fit),
                        layer_times_for(hw[plan.hw_e], shape, opt.dtype, opt.use_fit), workload,
                        opt.dtype)
    cap_a = model.hw_a.mem_bytes * model.hw_a.mem_util
    _, w, per_seq = model.attention_seqs(plan, cap_a)
    echo(memory_line(f"attention ({plan.n_a}x tp{plan.tp_a})", w, best.mem_attn, cap_a, per_seq,
                     workload.kv_len))
    echo(f"[plan] expert device ({plan.n_e}x tp{plan.tp_e}): weights {best.mem_expert / GiB:.4g} "
         f"GiB of {model.hw_e.mem_bytes * model.hw_e.mem_util / GiB:.4g} GiB usable")
    result = {"model": shape.name, "plans": [as_dict(r) for r in ranked[:opt.top]]}
    if opt.colocated:
        try:
            col = plan_colocated(shape, profiles[0], workload, space, opt.dtype, opt.use_fit)
            echo("\n[plan] best colocated baseline on " + profiles[0].name)
            echo(table(col, 1))
            _colocated_memory(shape, profiles[0], workload, opt, col[0], echo)
            ratio = best.tokens_per_s_per_device / col[0].pred.tokens_per_s_per_device
            echo(f"[plan] disaggregated / colocated tokens/s per device: {ratio:.2f}x")
            result["colocated"] = as_dict(col[0])
        except PlanError as e:
            echo(f"[plan] colocated baseline: no feasible plan ({e})")
    os.makedirs(opt.out_dir, exist_ok=True)
    sim = simulate_plan(model, plan, opt.jitter_s, opt.routing, opt.skew, seed=opt.seed)
    trace_path = os.path.join(opt.out_dir, "trace.json")
    sim.trace.write(trace_path, plan=as_dict(ranked[0]))
    echo(f"\n[plan] simulated iteration {sim.mean_iteration_s * 1e3:.2f} ms "
         f"(model T_total {best.t_total * 1e3:.2f} ms); trace: {trace_path}")
    if opt.timeline:
        png = os.path.join(opt.out_dir, "timeline.png")
        plot_trace(read_trace(trace_path), png, max_layer=opt.timeline_layers,
                   title=f"{shape.name}: {plan.label()} m={plan.m} B={plan.batch}")
        echo(f"[plan] timeline: {png}")
    with open(os.path.join(opt.out_dir, "plans.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def run_goodput(shape: ModelShape, roles, reqs, slo, space, dtype: str, use_fit: bool, top: int,
                out_dir: str, seed: int = 0, echo=print) -> dict:
    """Goodput planning (``workload.arrival_rate`` or ``workload.trace`` given): the search of
    ``goodput_search`` (with PD, the best PD candidate also with its decode attention offloaded:
    ``goodput_offload``), printed as the ranked plans, the chosen one and why (the offload's
    words, ``offload_choice``), and why the best is bound where it is;
    ``<out_dir>/goodput.json``."""
    from megainfer.perfmodel.plan.goodput_offload import choice_lines
    from megainfer.perfmodel.plan.goodput_search import search_goodput, why_bound
    from megainfer.perfmodel.plan.offload_choice import OFFLOAD_RATIOS
    span = float(reqs.arrival_s.max() - reqs.arrival_s.min())
    echo(f"[goodput] model={shape.name} prefill={roles.prefill.name} attention={roles.attention.name} "
         f"experts={roles.experts.name}; {len(reqs)} requests over {span:.3g} s, prompt mean "
         f"{reqs.prompt_len.mean():.0f}, output mean {reqs.output_len.mean():.0f}; SLO TTFT "
         f"{slo.ttft_s * 1e3:g} ms, TPOT {slo.tpot_s * 1e3:g} ms at p{slo.percentile:g}")
    out = search_goodput(shape, roles, reqs, slo, space, dtype, use_fit, seed,
                         OFFLOAD_RATIOS if "PD" in space.families else ())
    echo(f"[goodput] {len(out.candidates)} candidates after the closed-form prune, "
         f"{out.simulated} simulated, {len(out.ranked)} attain the SLOs"
         + (f", {out.unsimulated} left unsimulated (goodput.max_sims)" if out.unsimulated else ""))
    hdr = (f"{'#':>2} {'family':<6} {'plan':<72} {'dev':>4} {'$/h':>7} {'goodput/s':>9} "
           f"{'req/$':>8} {'req/dev-h':>9} {'TTFT p ms':>9} {'TPOT p ms':>9}")
    rows = [hdr]
    for i, c in enumerate(out.ranked[:top]):
        r = c.result
        rows.append(f"{i:>2} {c.family:<6} {c.label():<72} {c.devices:>4} {c.cost_per_hour:7.2f} "
                    f"{r.goodput_req_s:9.3g} {c.per_dollar():8.4g} {r.goodput_req_s * 3600 / c.devices:9.4g} "
                    f"{r.ttft_p * 1e3:9.4g} {r.tpot_p * 1e3:9.4g}")
    echo("\n".join(rows))
    for line in choice_lines(out, shape) + why_bound(out, slo):
        echo(f"[goodput] {line}")
    res = {"model": shape.name, "plans": [
        {"family": c.family, "label": c.label(), "devices": c.devices, "cost_per_hour": c.cost_per_hour,
         "goodput_req_s": c.result.goodput_req_s, "requests_per_dollar": c.per_dollar(),
         "ttft_p_s": c.result.ttft_p, "tpot_p_s": c.result.tpot_p, "attained": c.result.fraction,
         "offload_ratio": c.offload}
        for c in out.ranked[:top]], "ruled_out": out.ruled, "simulated": out.simulated}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "goodput.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def run_world_serving(shape: ModelShape, hw: HardwareProfile, reqs, slo, world: int,
                      max_num_seqs: int, max_num_batched_tokens: int, dtype: str, use_fit: bool,
                      top: int, out_dir: str, seed: int = 0, echo=print) -> dict:
    """Goodput planning over exactly ``world`` ranks of ``hw`` (``goodput.world_size``): what
    ``deploy=auto`` plans a server with (``world_serving.plan_world_serving``: AE and PD splits,
    the best PD split also with its decode attention offloaded), printed ranked, the chosen one
    first, and which was chosen and why (``offload_choice``'s words, as deploy=auto's log);
    ``<out_dir>/goodput.json``."""
    from megainfer.perfmodel.plan.offload_choice import (OFFLOAD_RATIOS, choice_lines, offload_keys,
                                                         runs_it)
    from megainfer.perfmodel.plan.world_serving import ServingTarget, plan_world_serving
    span = float(reqs.arrival_s.max() - reqs.arrival_s.min())
    echo(f"[goodput] model={shape.name} hardware={hw.name}, exactly {world} ranks (as deploy=auto "
         f"plans a server); {len(reqs)} requests over {span:.3g} s, prompt mean "
         f"{reqs.prompt_len.mean():.0f}, output mean {reqs.output_len.mean():.0f}; SLO TTFT "
         f"{slo.ttft_s * 1e3:g} ms, TPOT {slo.tpot_s * 1e3:g} ms at p{slo.percentile:g}")
    target = ServingTarget(reqs, slo, max_num_seqs, max_num_batched_tokens)
    ranked = plan_world_serving(shape, hw, target, world, dtype=dtype, use_fit=use_fit,
                                seed=seed, offload_ratios=OFFLOAD_RATIOS)
    rows = [f"{'#':>2} {'family':<6} {'plan':<80} {'goodput/s':>9} {'meet %':>6} "
            f"{'TTFT p ms':>9} {'TPOT p ms':>9}"]
    for i, c in enumerate(ranked[:top]):
        r = c.result
        rows.append(f"{i:>2} {c.family:<6} {c.label():<80} {r.goodput_req_s:9.4g} "
                    f"{100 * r.fraction:6.0f} {r.ttft_p * 1e3:9.4g} {r.tpot_p * 1e3:9.4g}")
    echo(f"[goodput] {len(ranked)} plans simulated")
    echo("\n".join(rows))
    if not ranked[0].result.ok:
        echo(f"[goodput] no simulated split of {world} ranks meets the SLOs for "
             f"{slo.percentile:g}% of the requests; the closest is chosen")
    best = ranked[0]
    by = runs_it(best.prefill[1], best.plan.tp_a, shape) if best.offload else ""
    for line in choice_lines(ranked, lambda c: c.describe(slo), by):
        echo(f"[goodput] {line}")
    res = {"model": shape.name, "world_size": world, "plans": [
        {"family": c.family, "label": c.label(), "offload_ratio": c.offload,
         "keys": offload_keys(c.offload) if c.pool else "", "goodput_req_s": c.result.goodput_req_s,
         "ttft_p_s": c.result.ttft_p, "tpot_p_s": c.result.tpot_p, "attained": c.result.fraction}
        for c in ranked[:top]]}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "goodput.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res
