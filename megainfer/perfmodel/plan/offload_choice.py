"""The decode-attention offload as one more serving candidate: the ratios a planner tries it at
and the words every planner says about it (``deploy=auto``'s log, ``megainfer-plan``'s output):
why an offloaded plan was chosen (``chosen_note``: its goodput and the fraction of requests
meeting the SLOs against the best plan without it) or why not (``not_chosen``), both after the
``chosen:`` line (``choice_lines``), and the ``pd.*`` keys that run a ratio (``offload_keys``,
``runs_it``). A candidate here is anything with ``label()``, ``offload`` (0: off) and a
simulated ``result`` (``goodput.Attainment``): ``world_serving.ServingChoice`` and
``goodput_search.Candidate``. docs/perfmodel.md, "Planning a server"."""
from __future__ import annotations

from typing import Callable, Optional

from megainfer.config.pd import offload_needs

OFFLOAD_RATIOS = (1.0, 0.5)  # pd.offload_ratio values the best PD split is also simulated at


def offload_keys(ratio: float) -> str:
    """The ``pd.*`` keys that run ``ratio`` (0: the offload off)."""
    return f"pd.offload=true pd.offload_ratio={ratio:g}" if ratio else "pd.offload=false"


def runs_it(prefill_tp: int, attention_tp: int, shape) -> str:
    """``runs it``, or what the runtime still needs for the offload on this split
    (``config.pd.offload_needs``; ``shape``: the planner's ModelShape, MLA by its latent KV)."""
    need = offload_needs(prefill_tp, attention_tp, bool(shape.kv_elems_override),
                         shape.kv_cache_dtype)
    return "runs it" if need is None else f"would run it (the runtime needs {need})"


def numbers(c, extra: Optional[Callable] = None) -> str:
    """``goodput X req/s, N% meet both`` (and ``extra(c)`` after it) of a simulated candidate."""
    r = c.result
    s = f"goodput {r.goodput_req_s:.4g} req/s, {100 * r.fraction:.0f}% meet both"
    return s + (f", {extra(c)}" if extra else "")


def best_without(ranked: list):
    """The best candidate without the offload (``ranked`` best first), or None."""
    return next((x for x in ranked if not x.offload), None)


def best_offloaded(ranked: list):
    """The best offloaded candidate (``ranked`` best first), or None."""
    return next((x for x in ranked if x.offload), None)


def chosen_note(chosen, without, by: str, extra: Optional[Callable] = None) -> str:
    """Why the offloaded ``chosen`` won, to follow its ``chosen:`` line: ``(decode attention
    offloaded: goodput X req/s, N% meet both, against Y req/s, M% meet both for the best plan
    without it, <label>; pd.offload=true pd.offload_ratio=R <by>)``."""
    against = (f"against {numbers(without, extra)} for the best plan without it, "
               f"{without.label()}" if without is not None else "no plan without it simulated")
    return (f" (decode attention offloaded: {numbers(chosen, extra)}, {against}; "
            f"{offload_keys(chosen.offload)} {by})")


def not_chosen(offloaded, chosen, extra: Optional[Callable] = None,
               measure: tuple = ("less goodput", lambda c: c.result.goodput_req_s),
               tie: str = "the same goodput, less SLO headroom") -> str:
    """Why the offload lost, one line: its best plan ranked below the chosen one (it misses the
    SLOs the chosen one meets, ``measure`` (its words, e.g. "less goodput", and its value of a
    candidate: the planner's ranking after the SLOs) or ``tie``), both with their numbers."""
    words, value = measure
    by = ("it misses the SLOs" if chosen.result.ok and not offloaded.result.ok else words
          if f"{value(offloaded):.4g}" != f"{value(chosen):.4g}" else tie)
    return (f"decode-attention offload not chosen: its best plan, {offloaded.label()} "
            f"({numbers(offloaded, extra)}), ranks below the chosen {chosen.label()} "
            f"({numbers(chosen, extra)}) on {by}; pd.offload stays false")


def choice_lines(ranked: list, describe: Callable, by: str, **why) -> list[str]:
    """``chosen: <describe(best)>`` of ``ranked`` (best first, offloaded candidates included),
    with ``chosen_note`` when the best is offloaded (``by``: who sets or runs the keys), else
    followed by ``not_chosen`` when an offloaded candidate was simulated. ``why``: ``extra``
    for both, ``measure`` and ``tie`` for ``not_chosen``."""
    best = ranked[0]
    line = f"chosen: {describe(best)}"
    if best.offload:
        return [line + chosen_note(best, best_without(ranked), by, why.get("extra"))]
    off = best_offloaded(ranked)
    return [line] + ([not_chosen(off, best, **why)] if off is not None else [])
