"""What the closed form (``DisaggModel.predict``) says about a whole job: the simulator's baseline.

The closed form knows one fixed batch: it cannot see arrival times, chunked prefill, the
scheduler's token budget, routing skew or requests of different lengths. Its job-level answer:
the requests run in waves of ``plan.batch`` that all arrive at t = 0; a wave's prompts are
prefilled in one pass (one iteration of B * mean-prompt tokens, attention at the chunk's mean
context (P + 1) / 2, balanced experts), then it decodes mean-output - 1 iterations of
``predict(plan).t_iter``. TTFT p50 = the prefill pass, TPOT p50 = t_iter, throughput = output
tokens / (waves * (prefill + (O - 1) * t_iter)).
"""
from __future__ import annotations

import math

from megainfer.perfmodel.model.disagg import DisaggModel, Plan
from megainfer.perfmodel.model.pipeline import micro_batch_sizes, t_total
from megainfer.perfmodel.sim.events import Requests


def closed_form_prefill(model: DisaggModel, plan: Plan, prompt_len: float) -> float:
    """One iteration prefilling ``plan.batch`` prompts of ``prompt_len`` tokens together."""
    s = model.shape
    b_a, b_e = micro_batch_sizes(plan.batch * prompt_len, plan.m, plan.n_a, s.num_experts, s.top_k)
    h_a, h_e, d_a, d_e = model.plan_node_terms(plan)
    t_a = (model.ta.t_attn(b_a, (prompt_len + 1) / 2, plan.tp_a) + h_a) * d_a
    t_e = (model.te.t_expert([b_e] * model.experts_per_rank(plan.n_e), plan.tp_e) + h_e) * d_e
    rows = plan.batch / (plan.m * plan.n_a)
    return t_total(t_a, t_e, model.t_comm(b_a, b_e, plan), plan.m, s.num_layers) \
        + plan.m * model.ta.t_head(rows, plan.tp_a)


def closed_form_job(model: DisaggModel, plan: Plan, requests: Requests,
                    iteration_overhead_s: float = 0.0) -> dict:
    """{"ttft_s_p50", "tpot_s_p50", "throughput_tok_s"} of ``requests`` by the closed form
    (``model.wl`` should carry the mean prompt and output lengths: t_iter's context);
    ``iteration_overhead_s``: host work added to every iteration, as ``JobConfig``'s."""
    n, B = len(requests), max(1, plan.batch)
    P, O = float(requests.prompt_len.mean()), float(requests.output_len.mean())
    ttft = closed_form_prefill(model, plan, P) + iteration_overhead_s
    tpot = model.predict(plan).t_iter + iteration_overhead_s
    makespan = math.ceil(n / B) * (ttft + (O - 1) * tpot)
    return {"ttft_s_p50": ttft, "tpot_s_p50": tpot, "throughput_tok_s": n * O / makespan}
