"""``deploy.*`` -> a ``DeployPlan`` that fits the world size: what the world size leaves no
choice about is inferred (colocated: one replica per rank; disaggregated: the missing count),
and a plan that does not fit names an override that would (docs/design_rules.md, rank order)."""
from __future__ import annotations

from typing import Optional

from .base import ConfigError
from .runtime import DeployPlan


COUNTS = ("attention_replicas", "attention_tp", "expert_ranks")
DEFAULT_MICRO_BATCHES = 2  # deploy.micro_batches=null outside the planner's choice


def _deploy_error(mode: str, world: int, have: dict, why: str, fixes: list[str]) -> ConfigError:
    plan = ", ".join(f"{k}={have[k]}" for k in COUNTS if have.get(k) is not None)
    fix = " or ".join(dict.fromkeys(fixes)) if fixes else "a different deploy plan"
    return ConfigError(f"world size {world} does not match deploy plan (mode={mode}"
                       + (f", {plan}" if plan else "") + f"): {why}; use {fix}")


def _colocated(d: dict, world: int) -> dict:
    tp, reps = d.get("attention_tp"), d.get("attention_replicas")
    if tp not in (None, 1):
        raise ConfigError(f"deploy.attention_tp={tp!r}: colocated mode runs data parallel "
                          "attention only (attention_tp=1)")
    if reps is not None and reps != world:
        raise _deploy_error("colocated", world, d, f"colocated runs one replica per rank, "
                            f"{reps} replicas need {reps} ranks",
                            [f"deploy.attention_replicas={world}", f"mpirun -n {reps}"])
    if d.get("expert_ranks") not in (None, 0):
        raise _deploy_error("colocated", world, d, "colocated ranks hold the experts themselves",
                            ["deploy.expert_ranks=0"])
    return dict(d, attention_replicas=world, attention_tp=1, expert_ranks=0)


def _fixes(world: int, reps: int, tp: int, exp: Optional[int]) -> list[str]:
    """Single overrides that make a disaggregated plan fit ``world`` ranks."""
    out = []
    if world - reps * tp >= 1:
        out.append(f"deploy.expert_ranks={world - reps * tp}")
    elif exp is None and (world - 1) // tp >= 1:
        out.append(f"deploy.attention_replicas={(world - 1) // tp}")
    if exp is None and tp == 1 and reps == world:
        out.append("deploy.mode=colocated")
    if exp is not None and exp >= 1:
        rest = world - exp
        if rest >= tp and rest % tp == 0:
            out.append(f"deploy.attention_replicas={rest // tp}")
        if rest >= reps and rest % reps == 0:
            out.append(f"deploy.attention_tp={rest // reps}")
    if not out and world >= 2:
        out.append("deploy.attention_replicas=1 deploy.attention_tp=1 "
                   f"deploy.expert_ranks={world - 1}")
    if world == 1:
        out.append("deploy=single (one process)")
    need = reps * tp + (exp if exp is not None and exp >= 1 else 1)
    if need != world:
        out.append(f"mpirun -n {need}")
    return out


def _disaggregated(d: dict, world: int) -> dict:
    """Fill the counts not given: attention_tp defaults to 1; with one of attention_replicas /
    expert_ranks given the other is what the world leaves; with neither, one replica (as
    deploy=auto). A plan that cannot fit names an override that would."""
    for k in COUNTS:  # DeployPlan names a bad type or value precisely; leave those to it
        v = d.get(k)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            return d
    reps, tp, exp = (d.get(k) for k in COUNTS)
    tp = 1 if tp is None else tp
    if exp is None:
        reps = 1 if reps is None else reps
        if world - reps * tp >= 1:
            return dict(d, attention_replicas=reps, attention_tp=tp, expert_ranks=world - reps * tp)
        why = f"{reps} attention replicas x tp {tp} leave no rank for the experts"
    elif reps is None:
        rest = world - exp
        if rest >= tp and rest % tp == 0:
            return dict(d, attention_replicas=rest // tp, attention_tp=tp, expert_ranks=exp)
        why = (f"{exp} expert ranks leave no rank for attention" if rest < 1 else
               f"{exp} expert ranks leave {rest} attention ranks, not a multiple of "
               f"attention_tp={tp}")
        reps = 1
    elif reps * tp + exp == world:
        return dict(d, attention_replicas=reps, attention_tp=tp, expert_ranks=exp)
    else:
        why = (f"it needs {reps * tp + exp} ranks ({reps} attention replicas x tp {tp} + {exp} "
               "expert ranks)")
    have = dict(d, attention_replicas=d.get("attention_replicas"), attention_tp=tp,
                expert_ranks=d.get("expert_ranks"))
    raise _deploy_error("disaggregated", world, have, why, _fixes(world, reps, tp, exp))


def prefill_ranks(d: dict) -> int:
    """``prefill_replicas x prefill_tp`` (docs/pd.md) when valid (DeployPlan names bad ones)."""
    p, tp = d.get("prefill_replicas") or 0, d.get("prefill_tp") or 1
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (p, tp))
    return p * tp if ok else 0


def plan_for_world(d: dict, world_size: int) -> DeployPlan:
    """``deploy.*`` -> DeployPlan. The counts (attention_replicas, attention_tp, expert_ranks)
    may be null: ``auto`` picks single for one process, else disaggregated (with N > 1 ranks
    ``megainfer/perfmodel/plan/auto_plan.py`` has already filled in the planner's choice); colocated takes one
    replica per rank; disaggregated fills what is not given where the world size leaves one
    choice. A plan that does not fit the world size names an override that would."""
    d = dict(d)
    if d.get("micro_batches") is None:  # not chosen by the planner (megainfer/perfmodel/plan/auto_plan.py)
        d["micro_batches"] = DEFAULT_MICRO_BATCHES
    mode = d.get("mode", "auto")
    if mode in (None, "auto"):
        given = any(d.get(k) is not None for k in ("attention_replicas", "expert_ranks")) or \
            d.get("attention_tp") not in (None, 1)
        if world_size == 1 and not given:
            d = dict(mode="single", attention_replicas=1, attention_tp=1, expert_ranks=0,
                     micro_batches=1)
        else:
            mode = d["mode"] = "disaggregated"
    if mode == "single":
        d = {**{k: v for k, v in d.items() if v is not None},
             **{k: dflt for k, dflt in (("attention_replicas", 1), ("attention_tp", 1),
                                        ("expert_ranks", 0)) if d.get(k) is None}}
    elif mode == "colocated":
        d = _colocated(d, world_size)
    elif mode == "disaggregated":
        pre = prefill_ranks(d)  # prefill ranks come last: the rest is sized as without them
        try:
            d = _disaggregated(d, world_size - pre)
        except ConfigError as e:
            if not pre:
                raise
            raise ConfigError(f"{e} (counting the ranks left after deploy.prefill_replicas x "
                              f"prefill_tp = {pre} prefill ranks, of {world_size} in all; "
                              f"add {pre} to any mpirun -n named)") from e
    d = {k: v for k, v in d.items() if v is not None}
    plan = DeployPlan(**d)
    if plan.world_size != world_size:
        if world_size == 1:
            fix = f"; use mpirun -n {plan.world_size}, or deploy=single for one process"
        elif plan.mode == "single":
            fix = ("; single mode runs one process: drop mpirun, or use "
                   "deploy.mode=disaggregated or deploy.mode=colocated")
        else:
            fix = ""
        raise ConfigError(
            f"world size {world_size} does not match deploy plan {plan}: it needs "
            f"{plan.world_size} ranks ({plan.attention_replicas} attention replicas x tp "
            f"{plan.attention_tp}" + (f" + {plan.expert_ranks} expert ranks" if plan.mode ==
                                      "disaggregated" else "")
            + (f" + {plan.prefill_ranks} prefill ranks" if plan.prefill_ranks else "") + ")" + fix)
    return plan
