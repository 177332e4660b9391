"""``mpiexec -n 3 megainfer-serve deploy=a1e2 replan.enabled=true``, and a plain
``megainfer-serve`` whose engine core is a child job of 3 ranks, with forced switches
(a1e2 -> a2e1 -> a1e2 -> a2e1, each at the first iteration with work once its iteration has
come): through the official openai client, concurrent streams across the switches, then
completions, streamed and not, on the plan they left, give the greedy text ``LLM.generate``
gives in single mode; ``megainfer:replans_total`` counts the three switches and ``/health``
stays 200; with tracing on, the expert ranks' T_e spans keep reaching rank 0 from the workers
the switches rebuilt; SIGTERM drains and the job exits 0, leaving no process."""
import asyncio
import signal

import httpx
import openai
import pytest

from megainfer import LLM, SamplingParams
from serve_util import MpiServe, gauge, wait_for
from test_serve_modes import KW, OVERRIDES, PROMPTS, _streams

FORCE = "[[1,a2e1],[2,a1e2],[3,a2e1]]"  # idle iterations pass them: the first three with work


@pytest.mark.parametrize("plain", [False, True], ids=["mpiexec", "plain"])
def test_served_replanning_equals_single_mode(tiny_ckpts, plain):
    ckpt = tiny_ckpts[("mixtral", "base")]
    want = [o.outputs[0].text for o in LLM(ckpt, **KW).generate(
        PROMPTS, [SamplingParams(temperature=0, max_tokens=4 + i) for i in range(8)],
        use_tqdm=False)]
    srv = MpiServe(None if plain else 3, [
        "deploy=a1e2", f"model.path={ckpt}", "serve.served_model_name=tiny", *OVERRIDES,
        "replan.enabled=true", f"replan.force_schedule={FORCE}", "trace.enabled=true"])
    try:
        url = srv.url
        assert httpx.get(url + "/health").status_code == 200
        assert gauge(url, "replans_total") == 0
        assert asyncio.run(_streams(url, 8)) == want  # the switches come with these
        wait_for(lambda: gauge(url, "replans_total") == 3, 30, "three switches")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="tiny", prompt=PROMPTS[:3], max_tokens=4,
                                      temperature=0)
        assert sorted(r.choices, key=lambda c: c.index)[0].text == want[0]
        r = client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=9,
                                      temperature=0)
        assert r.choices[0].text == want[5] and r.usage.completion_tokens == 9
        chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=9,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want[5]
        t_e = gauge(url, "expert_layer_seconds_count")
        assert asyncio.run(_streams(url, 8)) == want  # two replicas now
        wait_for(lambda: gauge(url, "expert_layer_seconds_count") > t_e, 10,
                 "T_e from the expert rank the last switch rebuilt")
        assert httpx.get(url + "/health").status_code == 200
        assert gauge(url, "replans_total") == 3  # no more
        srv.signal(signal.SIGTERM)
        assert srv.wait(60) == 0, srv.output()
        wait_for(lambda: not srv.alive_pids(), 10, "every rank gone")
    finally:
        srv.close()
