"""``LLM(deploy=...)`` / ``AsyncLLM(deploy=...)`` under mpiexec: every rank runs this script,
``LLM(...)`` returns on rank 0 only (the others serve inside it and exit 0), rank 0 dumps JSON.

    mpiexec -n K python llm_deploy_job.py OUT.json CKPT DEPLOY {offline|async} [OVERRIDE ...]

DEPLOY: a conf/deploy preset name or a JSON mapping of ``deploy.*`` keys. ``offline``:
``offline_outputs`` (greedy, seeded n=2, n above max_num_seqs, logprobs, stop strings,
chat); ``async``: ``async_outputs`` (concurrent streams, aborts, requests added while others run). The tests
run the same functions in single mode in process as the reference.
"""
import asyncio
import dataclasses
import json
import os
import sys

import torch

torch.set_num_threads(1)

from abort_on_error import run_or_abort  # noqa: E402

ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, block_size=4,
                   num_blocks=256)
CHAT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["a", "bc"]},
                                           "v": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "f": {"type": "array", "items": {"type": "boolean"},
                                                 "maxItems": 2}},
          "required": ["k", "v", "f"], "additionalProperties": False}


def prompts(vocab: int):
    """7 prompts, 1..40 tokens: the 40- and 30-token ones need chunked prefill at 32."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in (3, 40, 9, 1, 23, 17, 30)]


def offline_outputs(llm) -> dict:
    from megainfer import SamplingParams
    ps = [{"prompt_token_ids": p} for p in prompts(llm.model_config.vocab_size)]
    greedy = llm.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)
    seeded = llm.generate(ps[:4], [SamplingParams(temperature=1.0, seed=5 + i, n=2, max_tokens=8)
                                   for i in range(4)], use_tqdm=False)
    lps = llm.generate(ps[:2], SamplingParams(temperature=0, max_tokens=4, logprobs=2),
                       use_tqdm=False)
    text = greedy[0].outputs[0].text
    stop = llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=12, stop=[text[4:6]]),
                        use_tqdm=False)
    biased = llm.generate(ps[:3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                 logit_bias={7: 2.0, 11: -3.0}), use_tqdm=False)
    wide = llm.generate(ps[2:4], [SamplingParams(temperature=1.0, seed=3, n=12, max_tokens=6),
                                  SamplingParams(temperature=0, n=10, max_tokens=6,
                                                 ignore_eos=True)], use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0,
                                                                         max_tokens=5),
                    use_tqdm=False, chat_template=CHAT)
    grammar = [SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": SCHEMA}),
               SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=60,
                              structured_outputs={"json": SCHEMA}),
               SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=12,
                              structured_outputs={"regex": r"[a-e]{2,5}\d"})]
    structured = llm.generate(ps[:3], grammar, use_tqdm=False)  # the sampler's masks, every mode
    return {
        "structured": [[c.text for c in o.outputs] for o in structured],
        "greedy": [o.outputs[0].token_ids for o in greedy],
        "greedy_text": [o.outputs[0].text for o in greedy],
        "seeded": [[c.token_ids for c in o.outputs] for o in seeded],
        "logprobs": [[sorted([t, lp.logprob] for t, lp in pos.items())
                      for pos in o.outputs[0].logprobs] for o in lps],
        "stop": [stop[0].outputs[0].text, stop[0].outputs[0].finish_reason],
        "chat": chat[0].outputs[0].token_ids,
        "biased": [o.outputs[0].token_ids for o in biased],  # logit_bias, the first token too
        "wide_n": [[c.token_ids for c in o.outputs] for o in wide],  # n > max_num_seqs (8)
    }


async def _stream(engine, rid, prompt, params, abort_after=None):
    """(token counts of the outputs seen, final token ids per sample, finish reasons)."""
    seen = []
    async for out in engine.generate({"prompt_token_ids": prompt}, params, rid):
        seen.append(len(out.outputs[0].token_ids))
        if abort_after is not None and len(seen) == abort_after:
            await engine.abort(rid)
    return {"seen": seen, "tokens": [c.token_ids for c in out.outputs],
            "finish": [c.finish_reason for c in out.outputs], "finished": out.finished}


async def _async_job(engine) -> dict:
    from megainfer import SamplingParams
    ps = prompts(engine.job.model.vocab_size if engine.job else 100)
    ps = (ps * 3)[:16]
    params = [SamplingParams(temperature=0, max_tokens=4 + i % 9, ignore_eos=True)
              if i % 4 else SamplingParams(temperature=1.0, seed=i, max_tokens=6)
              for i in range(16)]
    first = [asyncio.create_task(_stream(engine, f"s{i}", ps[i], params[i])) for i in range(8)]
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    aborted = asyncio.create_task(_stream(engine, "long", ps[1], long, abort_after=3))
    await asyncio.sleep(0.05)  # the rest arrive while the first ones run
    later = [asyncio.create_task(_stream(engine, f"s{i}", ps[i], params[i]))
             for i in range(8, 16)]
    early = asyncio.create_task(_stream(engine, "early", ps[4], long, abort_after=1))
    # aborted before its first token: waiting on rank 0, or (PD) on a prefill rank / KV in flight
    at_once = asyncio.create_task(_stream(engine, "at_once", ps[1], long))
    await asyncio.sleep(0.01)
    await engine.abort("at_once")
    streams = await asyncio.gather(*first, *later)
    got = {"streams": streams, "aborted": await aborted, "early": await early,
           "at_once": await at_once}
    # JSON-schema streams (greedy, and seeded n=2), after the timed ones: AsyncLLM compiles a
    # grammar on its event loop, which would delay the others' chunks
    got["grammar"] = await asyncio.gather(*[_stream(engine, f"g{i}", ps[2 + i], SamplingParams(
        temperature=float(i), seed=i, n=1 + i, max_tokens=60,
        structured_outputs={"json": SCHEMA})) for i in range(2)])
    await asyncio.sleep(0.3)  # the aborts' blocks come back at the replicas' next iterations
    if engine.engine is not None:  # rank 0's replica (the runtime's RuntimeEngine.engine)
        eng = getattr(engine.engine, "engine", engine.engine)
        got["free_blocks"] = [eng.blocks.num_free_blocks, eng.blocks.num_blocks]
        got["engine_detokenizes"] = eng.detokenize  # online the frontend decodes, not the engine
        ledger = getattr(getattr(getattr(engine.engine, "loop", None), "pd", None), "offload", None)
        if ledger is not None:  # pd.offload: requests offloaded, and the pools' room all back
            got["offload"] = [ledger.offloaded, ledger.free == [ledger.pool_blocks] * len(ledger.free),
                              ledger.sent_home]
    return got


def async_outputs(engine) -> dict:
    return asyncio.run(_async_job(engine))


def main():
    from mpi4py import MPI
    pids = MPI.COMM_WORLD.allgather(os.getpid())  # before LLM(...): only rank 0 leaves it
    out, ckpt, deploy, what = sys.argv[1:5]
    overrides = ["comm.timeout_s=30", *sys.argv[5:]]
    deploy = json.loads(deploy) if deploy.startswith("{") else deploy
    if what == "offline":
        from megainfer import LLM
        llm = LLM(ckpt, deploy=deploy, overrides=overrides, **ENGINE_ARGS)
    else:
        from megainfer import AsyncLLM
        llm = AsyncLLM(ckpt, deploy=deploy, overrides=overrides, **ENGINE_ARGS)
    with open(f"{out}.after.{MPI.COMM_WORLD.Get_rank()}", "w"):  # code after LLM(): rank 0 only
        pass
    got = offline_outputs(llm) if what == "offline" else async_outputs(llm)
    got["plan"] = dataclasses.asdict(llm.job.deploy)  # what this launch runs (deploy=auto: chose)
    if what == "offline":
        from megainfer.bench.process_cpu import idle_cpu
        got["idle_cpu"] = idle_cpu(pids, 2.0)
        llm.close()
    else:
        llm.shutdown()
    with open(out, "w") as f:
        json.dump(got, f)


if __name__ == "__main__":
    run_or_abort(main)
