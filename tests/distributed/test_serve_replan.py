"""``mpiexec -n 3 megainfer-serve deploy=a1e2 replan.enabled=true`` with forced switches
(a1e2 -> a2e1 -> a1e2 -> a2e1, each at the first iteration with work once its iteration has
come): through the official openai client, concurrent streams across the switches, then
completions, streamed and not, on the plan they left, give the greedy text ``LLM.generate``
gives in single mode; rank 0 logs each switch (the runtime's log on: ``runtime_log/``);
SIGTERM drains and the job exits 0, leaving no process."""
import asyncio
import os
import re
import signal

import httpx
import openai

from megainfer import LLM, SamplingParams
from serve_util import MpiServe, wait_for
from test_serve_modes import KW, OVERRIDES, PROMPTS, _streams

FORCE = "[[1,a2e1],[2,a1e2],[3,a2e1]]"  # idle iterations pass them: the first three with work
RUNTIME_LOG = os.path.join(os.path.dirname(__file__), "runtime_log")  # its sitecustomize
SWITCHED = re.compile(r"\[replan\] iteration \d+: (a\de\d) -> (a\de\d) \(forced\)")


def test_served_replanning_equals_single_mode(tiny_ckpts, monkeypatch):
    ckpt = tiny_ckpts[("mixtral", "base")]
    want = [o.outputs[0].text for o in LLM(ckpt, **KW).generate(
        PROMPTS, [SamplingParams(temperature=0, max_tokens=4 + i) for i in range(8)],
        use_tqdm=False)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [RUNTIME_LOG] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    srv = MpiServe(3, ["deploy=a1e2", f"model.path={ckpt}", "serve.served_model_name=tiny",
                       *OVERRIDES, "replan.enabled=true", f"replan.force_schedule={FORCE}"])
    try:
        url = srv.url
        assert httpx.get(url + "/health").status_code == 200
        assert asyncio.run(_streams(url, 8)) == want  # the switches come with these
        wait_for(lambda: len(SWITCHED.findall("\n".join(srv.lines))) == 3, 60, "three switches")
        assert SWITCHED.findall("\n".join(srv.lines)) == [("a1e2", "a2e1"), ("a2e1", "a1e2"),
                                                   ("a1e2", "a2e1")]
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
        assert asyncio.run(_streams(url, 8)) == want  # two replicas now
        assert httpx.get(url + "/health").status_code == 200
        srv.signal(signal.SIGTERM)
        assert srv.wait(60) == 0, srv.output()
        wait_for(lambda: not srv.alive_pids(), 10, "every rank gone")
    finally:
        srv.close()
