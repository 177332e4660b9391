"""Simulators over the model's times (docs/perfmodel.md): one fixed batch through the pipeline
event by event (``fixed_batch``), whole jobs with arrivals and continuous batching on a
disaggregated or colocated plan (``job``, ``job_colocated``), a PD split on one clock (``pd``),
and the closed form's job-level answer as their baseline (``closed_form``). Imports ``model``
and the trace writer, never ``plan``."""
from megainfer.perfmodel.sim.closed_form import closed_form_job, closed_form_prefill
from megainfer.perfmodel.sim.events import (LengthDist, Requests, Routing, draw_counts, fair_share,
                                            makespan, makespan_outer, poisson_requests,
                                            read_request_trace)
from megainfer.perfmodel.sim.fixed_batch import SimConfig, SimResult, simulate, simulate_plan
from megainfer.perfmodel.sim.job import JobConfig, Pipeline, expert_times, simulate_job
from megainfer.perfmodel.sim.job_colocated import ColocatedPipeline, simulate_colocated_job
from megainfer.perfmodel.sim.job_result import JobResult
from megainfer.perfmodel.sim.pd import PdJobResult, simulate_pd_job

__all__ = [
    "closed_form_job", "closed_form_prefill", "LengthDist", "Requests", "Routing", "draw_counts",
    "fair_share", "makespan", "makespan_outer", "poisson_requests", "read_request_trace",
    "SimConfig", "SimResult", "simulate", "simulate_plan", "JobConfig", "Pipeline",
    "expert_times", "simulate_job", "ColocatedPipeline", "simulate_colocated_job", "JobResult",
    "PdJobResult", "simulate_pd_job",
]
