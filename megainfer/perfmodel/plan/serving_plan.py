"""``deploy=auto`` planning a server: the config tree with ``slo.arrival_rate`` set -> the AE or
PD split of exactly N ranks that best meets ``slo.*`` (``world_serving.plan_world_serving``),
and whether its decode attention is offloaded, logged with its runner-up (docs/perfmodel.md,
"Planning a server").

The planned requests are ``slo.num_requests`` Poisson arrivals at ``slo.arrival_rate`` of
``slo.input_len`` / ``slo.output_len`` tokens (seeded: every rank plans the same); the
scheduler's ``max_num_seqs`` and ``max_num_batched_tokens`` are the simulated ones. Explicit
``deploy.*`` counts pin their dimension (``deploy.prefill_replicas=0``: AE only); re-planning
(``replan.enabled``) takes AE only (it does not re-plan prefill ranks yet). The best PD split
is also simulated with its decode attention offloaded (``offload_choice.OFFLOAD_RATIOS`` and
``pd.offload_ratio``). With ``pd.offload`` unset (absent, or the launcher's null) the offload is
the planner's: the best of every simulated plan is chosen, and an offloaded one sets
``pd.offload=true`` and its ``pd.offload_ratio``; the log says why it was chosen or not. An
explicit ``pd.offload`` pins it: the plan chosen is the best the config runs, and the log says
how the ratios compared and which keys would run a better one."""
from __future__ import annotations

import logging

from megainfer.config import SchedulerConfig, SloConfig
from megainfer.config.base import is_number
from megainfer.config.pd import PdConfig, offload_needs
from megainfer.config.keys import field_names

from .auto_plan import _max_seqs, calibrate_hint, hardware_for, job_shape, plan_dtype
from .offload_choice import (OFFLOAD_RATIOS, best_offloaded, best_without, chosen_note,
                             not_chosen, offload_keys)

log = logging.getLogger("megainfer.perfmodel")


def serving_plan(c: dict, d: dict, hw_name, pins: dict, world: int, sched: dict
                 ) -> tuple[dict, dict, dict]:
    """(``deploy``, ``scheduler``, ``pd``): the chosen split filled into ``d``; ``max_num_seqs``
    lowered to its decode batch limit when the TPOT SLO or the KV memory bound it lower; ``pd``
    the ``pd`` group, with ``offload=true`` and the chosen ``offload_ratio`` when ``pd.offload``
    was unset and an offloaded plan ranked first."""
    from megainfer.perfmodel.plan.goodput import Slo
    from megainfer.perfmodel.plan.world_serving import (NoWorldPlanError, ServingPins,
                                                        ServingTarget, plan_world_serving)
    from megainfer.perfmodel.sim.events import LengthDist, poisson_requests
    raw = c.get("slo") or {}
    slo_cfg = SloConfig(**{k: v for k, v in raw.items() if k in field_names(SloConfig)})
    replan = bool((c.get("replan") or {}).get("enabled"))
    if replan and pins.get("prefill_replicas") is None:
        pins = dict(pins, prefill_replicas=0)  # re-planning runs without prefill ranks
    hw, hw_from = hardware_for(hw_name, d.get("device"))
    shape = job_shape(c, hw)
    slo = Slo(slo_cfg.ttft_ms / 1e3, slo_cfg.tpot_ms / 1e3, slo_cfg.percentile)
    reqs = poisson_requests(slo_cfg.num_requests, slo_cfg.arrival_rate,
                            LengthDist("fixed", slo_cfg.input_len),
                            LengthDist("fixed", slo_cfg.output_len), seed=0)
    tokens = int(sched.get("max_num_batched_tokens") or SchedulerConfig.max_num_batched_tokens)
    target = ServingTarget(reqs, slo, _max_seqs(sched), tokens)
    pd_cfg = dict(c.get("pd") or {})
    free = pd_cfg.get("offload") is None  # unset: the planner chooses the offload
    given = pd_cfg.get("offload_ratio", PdConfig.offload_ratio)
    given = float(given) if is_number(given) and 0 < given <= 1 else 0.0  # PdConfig names a bad one
    run = given if pd_cfg.get("offload") else 0.0
    try:
        ranked = plan_world_serving(shape, hw, target, world, ServingPins(**pins),
                                    plan_dtype(c, d, hw),
                                    offload_ratios=tuple(sorted({*OFFLOAD_RATIOS, given} - {0.0})))
    except NoWorldPlanError as e:  # deploy.py then fills the counts or names a fix
        log.info("[plan] %s; the counts are inferred from the world size instead", e)
        return d, sched, pd_cfg
    if free:  # every plan, but no offload the runtime refuses for now
        need = _offload_needs(ranked, c)
        runs = [x for x in ranked if not x.offload or not need]
    else:
        runs = [x for x in ranked if x.family == "AE" or x.offload == run]
    best = runs[0] if runs else ranked[0]
    timing = "calibrated fit" if shape.name in hw.fits else "roofline"
    log.info("[plan] deploy=auto over %d ranks for serving %g requests/s (in %d, out %d; SLO "
             "TTFT %g ms, TPOT %g ms at p%g): hardware %s (%s); %s timed by %s; %d plans "
             "simulated", world, slo_cfg.arrival_rate, slo_cfg.input_len, slo_cfg.output_len,
             slo_cfg.ttft_ms, slo_cfg.tpot_ms, slo_cfg.percentile, hw.name, hw_from, shape.name,
             timing, len(ranked))
    if "preset" in hw_from:
        log.info(calibrate_hint())
    why = (chosen_note(best, best_without(ranked), "set by the planner")
           if free and best.offload else "")
    if best.result.ok:
        log.info("[plan] chosen: %s%s", best.describe(slo), why)
    else:
        log.warning("[plan] no simulated split of %d ranks meets the SLOs for %g%% of the "
                    "requests; running the closest: %s%s", world, slo_cfg.percentile,
                    best.describe(slo), why)
    others = [x for x in runs if x is not best]  # the runner-up the config could run
    if others:
        log.info("[plan] runner-up: %s", others[0].describe(slo))
    if free:
        _log_free_offload(ranked, best, pins, replan, need)
    else:
        _log_offload(ranked, best, run, slo)
    p = best.plan
    if best.batch_limit < _max_seqs(sched):
        log.info("[plan] batch limit applied: scheduler.max_num_seqs %d -> %d per decode "
                 "replica (the TPOT SLO or the KV memory bounds the plan's batch)",
                 _max_seqs(sched), best.batch_limit)
        sched = dict(sched, max_num_seqs=best.batch_limit)
    if free and best.offload:
        pd_cfg.update(offload=True, offload_ratio=best.offload)
    n_p, tp_p = best.prefill
    return dict(d, mode="disaggregated", attention_replicas=p.n_a, attention_tp=p.tp_a,
                expert_ranks=p.n_e, micro_batches=p.m, prefill_replicas=n_p,
                prefill_tp=tp_p), sched, pd_cfg


def _offload_needs(ranked: list, c: dict):
    """What the runtime needs for the offload on the PD split it was simulated on, that the
    split or the cache lacks (``config.pd.offload_needs``), or None."""
    from megainfer.config.model_source import model_config_of
    off = best_offloaded(ranked)
    if off is None:
        return None
    return offload_needs(off.prefill[1], off.plan.tp_a, model_config_of(c.get("model") or {}).is_mla,
                         (c.get("cache") or {}).get("kv_cache_dtype") or "auto")


def _log_free_offload(ranked: list, best, pins: dict, replan: bool, need) -> None:
    """``pd.offload`` unset and no offloaded plan chosen: why not, in one line."""
    if best.offload:
        return  # the chosen line says why
    off = best_offloaded(ranked)
    if off is not None and need:
        log.info("[plan] decode-attention offload not chosen: %s would rank %s, but pd.offload "
                 "needs %s; pd.offload stays false", off.label(),
                 "first" if off is ranked[0] else f"#{ranked.index(off) + 1}", need)
    elif off is not None:
        log.info("[plan] %s", not_chosen(off, best))
    elif pins.get("prefill_replicas") == 0:
        log.info("[plan] decode-attention offload not considered: it needs prefill ranks and "
                 "%s plans AE only; pd.offload stays false",
                 "replan.enabled" if replan else "deploy.prefill_replicas=0")
    else:
        log.info("[plan] decode-attention offload not considered: no simulated PD split takes "
                 "it; pd.offload stays false")


def _log_offload(ranked: list, best, run: float, slo) -> None:
    """How the best PD split did at each offload ratio simulated, and, when a ratio the config
    does not run ranks above the chosen plan, the keys that would run it."""
    split = [x for x in ranked if x.offload]
    if not split:
        return
    key = lambda x: (x.plan.label(), x.plan.m, x.prefill)  # noqa: E731  the split, any batch
    same = [x for x in ranked if x.pool is not None and key(x) == key(split[0])]
    seen = {}
    for x in same:  # best first, one per ratio
        seen.setdefault(x.offload, x)
    order = ", ".join(f"ratio {r:g}: goodput {x.result.goodput_req_s:.4g} req/s, "
                      f"{100 * x.result.fraction:.0f}% meet both" for r, x in seen.items())
    log.info("[plan] decode-attention offload on %s, ranked: %s; the config runs ratio %g "
             "(pd.offload=%s)", split[0].pool.label(), order, run, "true" if run else "false")
    top = ranked[0]
    if top is not best and top.offload != run:
        log.info("[plan] %s would rank above the chosen plan (%s): %s runs it",
                 top.label(), "meets the SLOs" if top.result.ok else "closer to the SLOs",
                 offload_keys(top.offload))
