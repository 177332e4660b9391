"""Run one disaggregated job under mpiexec and dump rank 0's outputs as JSON.

    mpiexec -n K python runtime_job.py CKPT OUT.json A TP E M [max_tokens] [chunk]
E = 0 runs colocated mode over the A ranks.
Prompts are fixed (seeded) so the single-mode reference can be computed the same way.
"""
import json
import sys

import torch

torch.set_num_threads(1)

from megainfer.config import CacheConfig, DeployPlan, LoadConfig, ModelConfig, SchedulerConfig  # noqa
from megainfer.engine.outputs import PromptInput  # noqa
from megainfer.engine.sampling_params import SamplingParams  # noqa
from megainfer.runtime.world import JobSpec, RuntimeConfig, build_rank, run_rank  # noqa


def prompts(vocab: int, n: int = 7):
    g = torch.Generator().manual_seed(11)
    lens = [3, 40, 9, 1, 23, 17, 5, 30, 12][:n]
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


def main():
    ckpt, out, A, TP, E, M = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    max_tokens = int(sys.argv[7]) if len(sys.argv) > 7 else 12
    chunk = int(sys.argv[8]) if len(sys.argv) > 8 else 32
    cfg = ModelConfig.from_pretrained(ckpt)
    plan = DeployPlan(mode="disaggregated" if E else "colocated", attention_replicas=A,
                      attention_tp=TP, expert_ranks=E, micro_batches=M)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=chunk, max_model_len=128)
    r = build_rank(JobSpec(cfg, LoadConfig(path=ckpt), sched, CacheConfig(block_size=4, num_blocks=256),
                           plan, RuntimeConfig(timeout_s=60)))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    inputs = [PromptInput(f"r{i}", prompt_token_ids=p, params=params)
              for i, p in enumerate(prompts(cfg.vocab_size))]
    stream = run_rank(r, inputs)
    if stream is not None:
        res = {o.request_id: o.outputs[0].token_ids for o in stream}
        with open(out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
