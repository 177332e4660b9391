"""``mpiexec -n 3 megainfer-serve deploy=a1e2 replan.enabled=true replan.policy=planner``: the
live planner inside the server, fed by the served traffic (two requests one at a time, then
bursts of 16 concurrent streams until it switches). It decides every second; configuration
makes it decisive: a hardware profile 1000 times slower than this machine's, a TTFT SLO of
100 ms that the launch's assignment is predicted to miss at the served load (so its first
decision with traffic, on the light or the burst window, orders a switch), ``min_gain=0``,
``switch_s=0``, ``confirm=1`` and a dwell that allows one switch. From a1e2m2 the simulator
picks a1e2m1 (the micro-batch count); from a2e1m2 with ``replan.micro_batches=hold`` it picks
a1e2m2, so the roles change: an attention replica becomes an expert rank, its requests handed
over. The order goes through the online re-plan path; every request is answered with
``LLM.generate``'s greedy text in single mode, before, across and after the switch;
``GET /planner`` shows the switch with its reason, numbers and window; the metrics count it
(``planner_decisions_total{outcome="switch"}``, ``replans_total``,
``replan_switch_seconds{kind="planner"}``); SIGTERM drains and the job exits 0."""
import asyncio
import signal
import time

import httpx
import openai
import pytest
import yaml

from megainfer import LLM, SamplingParams
from megainfer.perfmodel.model.hardware import hardware_dir
from serve_util import MpiServe, gauge, wait_for
from test_serve_modes import KW, OVERRIDES, PROMPTS, _streams

SLOWER = 1000.0  # the planner's hardware profile: this many times slower than cpu_node


def _slow_profile(path) -> str:
    with open(f"{hardware_dir()}/cpu_node.yaml") as f:
        d = yaml.safe_load(f)
    d["name"] = "cpu_node_slow"
    d["matmul_flops"] = {k: v / SLOWER for k, v in d["matmul_flops"].items()}
    d["mem_bw_Bps"] /= SLOWER
    out = path / "cpu_node_slow.yaml"
    out.write_text(yaml.safe_dump(d))
    return str(out)


async def _burst(url):
    """16 concurrent streams (8 prompts twice): their texts, by prompt."""
    return list(await asyncio.gather(_streams(url, 8), _streams(url, 8)))


def _planner(url) -> dict:
    return httpx.get(url + "/planner").json()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start,extra", [
    ("a1e2m2", []),
    ("a2e1m2", ["deploy.attention_replicas=2", "deploy.expert_ranks=1",
                "replan.micro_batches=hold"])], ids=["a1e2", "a2e1-hold"])
def test_the_served_planner_switches_and_every_answer_is_single_modes(tiny_ckpts, tmp_path,
                                                                      start, extra):
    ckpt = tiny_ckpts[("mixtral", "base")]
    want = [o.outputs[0].text for o in LLM(ckpt, **KW).generate(
        PROMPTS, [SamplingParams(temperature=0, max_tokens=4 + i) for i in range(8)],
        use_tqdm=False)]
    srv = MpiServe(3, [
        "deploy=a1e2", f"model.path={ckpt}", "serve.served_model_name=tiny", *OVERRIDES,
        "replan.enabled=true", "replan.policy=planner", "replan.planner_interval_s=1",
        "replan.min_gain=0", "replan.switch_s=0", "replan.confirm=1", "replan.dwell_s=3600",
        f"+deploy.hardware={_slow_profile(tmp_path)}", "slo.ttft_ms=100", "slo.tpot_ms=1e6",
        "slo.num_requests=16", *extra])
    try:
        url = srv.url
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert _planner(url)["current"] == start  # deploy=a1e2's 2 micro-batches
        for i in (0, 3):  # light: one at a time
            r = client.completions.create(model="tiny", prompt=PROMPTS[i], temperature=0,
                                          max_tokens=4 + i)
            assert r.choices[0].text == want[i]
        t0 = time.monotonic()
        while not _planner(url)["counts"]["switch"]:  # bursts until the planner switches
            assert time.monotonic() - t0 < 90, f"no switch:\n{_planner(url)}\n{srv.output()}"
            assert asyncio.run(_burst(url)) == [want, want]
        wait_for(lambda: gauge(url, "replans_total") == 1, 120, "the ordered switch")
        view = _planner(url)
        switch = next(d for d in view["decisions"] if d["action"] == "switch")
        assert switch["current"] == start and switch["target"] == view["current"] != start
        if "replan.micro_batches=hold" in extra:  # the count held: the roles change
            assert view["current"] == "a1e2m2"
        assert "req/s" in switch["reason"] and switch["predicted"] and switch["window"]["arrivals"]
        assert asyncio.run(_streams(url, 8)) == want  # on the plan the planner chose
        r = client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=9,
                                      temperature=0)
        assert r.choices[0].text == want[5]
        m = httpx.get(url + "/metrics").text
        assert 'megainfer:planner_decisions_total{model_name="tiny",outcome="switch"} 1.0' in m
        assert 'megainfer:replan_switch_seconds_count{kind="planner",model_name="tiny"} 1.0' \
            in m, m
        assert httpx.get(url + "/health").status_code == 200
        assert gauge(url, "replans_total") == 1  # the dwell allows no second
        srv.signal(signal.SIGTERM)
        assert srv.wait(60) == 0, srv.output()
        wait_for(lambda: not srv.alive_pids(), 30, "every rank gone")
    finally:
        srv.close()
