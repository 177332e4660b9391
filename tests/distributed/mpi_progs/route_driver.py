"""``python route_driver.py CKPT DEPLOY llm|async``: one greedy request through ``LLM`` or
``AsyncLLM`` in that deploy mode (test_one_route.py); prints its text as JSON."""
import asyncio
import json
import sys

from megainfer import LLM, AsyncLLM, SamplingParams

KW = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=64,
          block_size=4)


def main():
    ckpt, deploy, face = sys.argv[1:4]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    if face == "llm":
        with LLM(ckpt, deploy=deploy, **KW) as llm:
            text = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    else:
        engine = AsyncLLM(ckpt, deploy=deploy, **KW)

        async def one():
            async for out in engine.generate(prompt, params, request_id="route-async"):
                last = out
            return last.outputs[0].text
        try:
            text = asyncio.run(one())
        finally:
            engine.shutdown()
    print(json.dumps(text), flush=True)


if __name__ == "__main__":
    main()
