"""megainfer-plan's goodput search with the decode-attention offload beside plain PD and AE: the
best simulated PD candidate of ``goodput_search.search_goodput`` simulated again with its
decode attention offloaded to its prefill replicas at ``offload_choice.OFFLOAD_RATIOS`` (the
variant ``world_serving.offloaded_variant`` builds for ``deploy=auto``: seats up to
``goodput.max_batch`` and the TPOT SLO, the KV memory bounding its local requests only, each
prefill replica's offload pool half its KV memory), ranked among the attaining plans by the
same rule (requests per dollar); and the one line saying which was chosen and why.
docs/perfmodel.md, "Goodput planning"."""
from __future__ import annotations

from megainfer.perfmodel.model.prefill_pool import decode_model
from megainfer.perfmodel.plan.goodput_search import (Candidate, GoodputSpace, Outcome, Roles,
                                                     mean_workload)
from megainfer.perfmodel.plan import offload_choice
from megainfer.perfmodel.plan.offload_choice import OFFLOAD_RATIOS
from megainfer.perfmodel.plan.world_serving import (ServingChoice, ServingTarget,
                                                    offloaded_variant, simulate_choice)


def _rank_key(c: Candidate):
    return (not c.result.ok, -c.per_dollar(), c.cost_per_hour, c.label())


def add_offload(out: Outcome, shape, roles: Roles, reqs, slo, space: GoodputSpace, dtype: str,
                use_fit: bool, seed: int = 0, ratios: tuple = OFFLOAD_RATIOS) -> Outcome:
    """``out`` with the best simulated PD candidate's offloaded variants simulated (one
    simulation each: ``out.offloaded``, ``out.simulated``) and the attaining ones ranked into
    ``out.ranked``; unchanged when no PD candidate was simulated."""
    pd = sorted((c for c in out.candidates if c.pool is not None and c.result is not None),
                key=_rank_key)
    if not pd:
        return out
    base, wl = pd[0], mean_workload(reqs)
    model = decode_model(shape, roles.attention, roles.experts, wl, dtype, use_fit)
    target = ServingTarget(reqs, slo, space.max_batch, space.max_num_batched_tokens)
    plain = ServingChoice("PD", model.predict(base.decode), base.decode.batch // base.decode.n_a,
                          base.pool)
    for r in ratios:
        v = offloaded_variant(plain, r, model, target, roles.attention, wl) if r > 0 else None
        if v is None:
            continue
        v = simulate_choice(v, model, target, dtype, seed)
        out.simulated += 1
        c = Candidate("PD", v.plan, base.pool, v.decode.t_iter, v.result,
                      decode_cost=base.decode_cost, offload=r)
        if not c.result.ok:
            c.ruled_out = c.result.missed_bound(slo)
        out.offloaded.append(c)
        out.candidates.append(c)
    out.ranked = sorted(out.ranked + [c for c in out.offloaded if c.result.ok], key=_rank_key)
    return out


def _per_dollar(c: Candidate) -> str:
    return f"{c.per_dollar():.4g} req/$"


def choice_lines(out: Outcome, shape) -> list[str]:
    """``chosen: <family> <plan>``, with why when its decode attention is offloaded (against
    the best plan without it), and, when the offload was simulated and lost, why not
    (``offload_choice.choice_lines``, ranked by requests per dollar)."""
    ranked = out.ranked + [c for c in out.offloaded if not c.result.ok]  # the rest: ranked
    best = ranked[0]
    by = offload_choice.runs_it(best.pool.tp_p, best.decode.tp_a, shape) if best.offload else ""
    return offload_choice.choice_lines(
        ranked, lambda c: f"{c.family} {c.label()}", by, extra=_per_dollar,
        measure=("fewer requests per dollar", Candidate.per_dollar),
        tie="the same requests per dollar and cost")
