"""vLLM's per-request outputs across ranks: n seeded samples, logprobs, prompt_logprobs.

    mpiexec -n K python logprobs_job.py OUT.json A TP E M CKPT
E = 0 runs colocated mode over the A ranks. Rank 0 writes {request id: outputs} as
``summarize`` makes them (tests/unit/engine/test_sampling_params_vllm.py compares with single mode).
"""
import json
import sys

import torch

torch.set_num_threads(1)

from abort_on_error import run_or_abort  # noqa: E402
from runtime_job import CACHE, SCHED, prompts  # noqa: E402

from megainfer.config import CommConfig, DeployPlan, LoadConfig, ModelConfig  # noqa: E402
from megainfer.engine.outputs import PromptInput  # noqa: E402
from megainfer.engine.sampling_params import SamplingParams  # noqa: E402
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank  # noqa: E402

PARAMS = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=6, ignore_eos=True,
                        logprobs=3, prompt_logprobs=2)


def inputs(vocab: int):
    return [PromptInput(f"r{i}", prompt_token_ids=p, params=PARAMS)
            for i, p in enumerate(prompts(vocab))]


def summarize(out) -> dict:
    """JSON-safe: token ids, and every logprob dict as [[token, logprob, rank], ...]."""
    def lp(d):
        return None if d is None else sorted([t, v.logprob, v.rank] for t, v in d.items())
    return {"samples": [[c.token_ids, [lp(d) for d in c.logprobs], c.cumulative_logprob]
                        for c in out.outputs],
            "prompt": [lp(d) for d in out.prompt_logprobs]}


def main():
    out, A, TP, E, m = sys.argv[1], *map(int, sys.argv[2:6])
    ckpt = sys.argv[6]
    cfg = ModelConfig.from_pretrained(ckpt)
    plan = DeployPlan(mode="disaggregated" if E else "colocated", attention_replicas=A,
                      attention_tp=TP, expert_ranks=E, micro_batches=m)
    r = build_rank(ResolvedJob(cfg, LoadConfig(path=ckpt), SCHED, CACHE, plan, CommConfig(timeout_s=120)))
    stream = run_job(r, inputs(cfg.vocab_size))
    if stream is not None:
        with open(out, "w") as f:
            json.dump({o.request_id: summarize(o) for o in stream}, f)
    r.close()


if __name__ == "__main__":
    run_or_abort(main)
