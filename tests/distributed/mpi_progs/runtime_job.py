"""Run several disaggregated or colocated jobs in one mpiexec launch; rank 0 dumps outputs.

    mpiexec -n K python runtime_job.py OUT.json A TP E MS CKPT[,CKPT...] [max_tokens] [shared|kv=FMT]
MS is a comma list of micro-batch counts; E = 0 runs colocated mode over the A ranks.
``shared``: the shared-prefix prompts (``shared_inputs``) on a pool small enough to preempt
and evict, prefix caching on (``SHARED_CACHE``); ``kv=FMT[:GRAN]``: cache.kv_cache_dtype FMT
(and cache.kv_scale_granularity GRAN);
``tp=KIND``: comm.tp_collectives KIND; ``q=FMT``: model.quantization FMT (group size 32).
OUT.json maps "<ckpt>|m=<m>" to {request id: token ids}. Prompts are fixed (seeded) so the
single-mode reference is computed from the same ``prompts``.
"""
import json
import sys

import torch

torch.set_num_threads(1)

from abort_on_error import run_or_abort  # noqa: E402

from megainfer.config import (CacheConfig, CommConfig, DeployPlan, LoadConfig, ModelConfig,  # noqa
                              SchedulerConfig)
from megainfer.engine.outputs import PromptInput  # noqa
from megainfer.engine.sampling_params import SamplingParams  # noqa
from megainfer.config import ResolvedJob  # noqa: E402
from megainfer.core_client.client import run_job
from megainfer.runtime.startup import build_rank  # noqa

SCHED = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)
CACHE = CacheConfig(block_size=4, num_blocks=256)
SHARED_CACHE = CacheConfig(block_size=4, num_blocks=40, enable_prefix_caching=True)


def prompts(vocab: int):
    """7 prompts, 1..40 tokens: the 40- and 30-token ones need chunked prefill at 32."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in (3, 40, 9, 1, 23, 17, 30)]


def inputs(vocab: int, max_tokens: int, first_max_tokens=None):
    """Greedy requests of ``max_tokens`` each (the first ``first_max_tokens`` when given)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = params if first_max_tokens is None else \
        SamplingParams(temperature=0.0, max_tokens=first_max_tokens, ignore_eos=True)
    return [PromptInput(f"r{i}", prompt_token_ids=p, params=first if i == 0 else params)
            for i, p in enumerate(prompts(vocab))]


def shared_inputs(vocab: int, max_tokens: int):
    """12 prompts over 3 system prompts (13, 22, 8 tokens) with 1..6-token suffixes."""
    g = torch.Generator().manual_seed(12)
    systems = [torch.randint(3, vocab, (L,), generator=g).tolist() for L in (13, 22, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [PromptInput(f"s{i}", prompt_token_ids=systems[i % 3] + torch.randint(
        3, vocab, (1 + i % 6,), generator=g).tolist(), params=params) for i in range(12)]


def shared_reference(ckpt: str, max_tokens: int = 12):
    """Single mode with prefix caching off on ``shared_inputs``: ({request id: greedy tokens},
    the engine's preemption count). The oracle of the shared-prefix MPI tests."""
    import dataclasses

    from megainfer.engine.engine import LLMEngine
    from megainfer.models import build_model
    cfg = ModelConfig.from_pretrained(ckpt)
    off = dataclasses.replace(SHARED_CACHE, enable_prefix_caching=False)
    eng = LLMEngine.from_model(build_model(cfg, LoadConfig(path=ckpt)), SCHED, off)
    want = {o.request_id: o.outputs[0].token_ids
            for o in eng.generate_stream(shared_inputs(cfg.vocab_size, max_tokens))}
    return want, eng.num_preemptions


def dump_results(out: str, results: dict) -> None:
    """Rank 0's results (other ranks have none) as OUT.json."""
    if results:
        with open(out, "w") as f:
            json.dump(results, f)


def main():
    out, A, TP, E = sys.argv[1], *map(int, sys.argv[2:5])
    ms = [int(m) for m in sys.argv[5].split(",")]
    ckpts = sys.argv[6].split(",")
    max_tokens = int(sys.argv[7]) if len(sys.argv) > 7 else 12
    opt = sys.argv[8] if len(sys.argv) > 8 else ""
    shared = opt == "shared"
    make_inputs, cache = (shared_inputs, SHARED_CACHE) if shared else (inputs, CACHE)
    if opt.startswith("kv="):
        import dataclasses
        fmt, _, gran = opt[3:].partition(":")
        cache = dataclasses.replace(cache, kv_cache_dtype=fmt,
                                    kv_scale_granularity=gran or cache.kv_scale_granularity)
    comm = CommConfig(timeout_s=120, tp_collectives=opt[3:] if opt.startswith("tp=") else "auto")
    results = {}
    for ckpt in ckpts:
        cfg = ModelConfig.from_pretrained(ckpt)
        for m in ms:
            plan = DeployPlan(mode="disaggregated" if E else "colocated", attention_replicas=A,
                              attention_tp=TP, expert_ranks=E, micro_batches=m)
            quant = opt[2:] if opt.startswith("q=") else None
            r = build_rank(ResolvedJob(cfg, LoadConfig(path=ckpt, quantization=quant,
                                                       quantization_group_size=32),
                                       SCHED, cache, plan, comm))
            stream = run_job(r, make_inputs(cfg.vocab_size, max_tokens))
            if stream is not None:
                outs = list(stream)
                results[f"{ckpt}|m={m}"] = {o.request_id: o.outputs[0].token_ids for o in outs}
                tp = r.tp
                if tp is not None and tp.channel is not None:  # collectives sent point to point
                    results[f"{ckpt}|m={m}|tp_sent"] = tp.channel.sent
                if shared:  # prompt tokens the prefix cache served
                    results[f"{ckpt}|m={m}|cached"] = sum(o.num_cached_tokens or 0 for o in outs)
            r.close()
    dump_results(out, results)


if __name__ == "__main__":
    run_or_abort(main)
