"""Choosing a deployment (docs/perfmodel.md): the throughput planner (MegaScale-Infer
Algorithm 1), the goodput search under SLOs, the split of exactly N ranks that ``deploy=auto``
and re-plan ask for (``auto_plan.py``: the config tree's job at launch; ``world_serving.py``: a
server's AE or PD split under SLOs), the plan report, and
the calls ``megainfer-plan`` makes. Imports ``model`` and ``sim``; nothing below imports it."""
from megainfer.perfmodel.plan.api import PlanOptions, run_goodput, run_plan
from megainfer.perfmodel.plan.goodput import (Attainment, Slo, attainment, simulate_ae,
                                              simulate_pd, simulate_pd_composed)
from megainfer.perfmodel.plan.goodput_search import GoodputSpace, Roles, search_goodput, why_bound
from megainfer.perfmodel.plan.planner import (ModelTooLargeError, PlanError, Ranked, SearchSpace,
                                              SloUnreachableError, largest_batch, plan_colocated,
                                              plan_disaggregated)
from megainfer.perfmodel.plan.report import as_dict, table
from megainfer.perfmodel.plan.world_plan import JobLoad, NoWorldPlanError, Pins, WorldChoice, plan_world

__all__ = [
    "PlanOptions", "run_goodput", "run_plan", "Attainment", "Slo", "attainment", "simulate_ae",
    "simulate_pd", "simulate_pd_composed", "GoodputSpace", "Roles", "search_goodput", "why_bound",
    "ModelTooLargeError", "PlanError", "Ranked", "SearchSpace", "SloUnreachableError",
    "largest_batch", "plan_colocated", "plan_disaggregated", "as_dict", "table", "JobLoad",
    "NoWorldPlanError", "Pins", "WorldChoice", "plan_world",
]
