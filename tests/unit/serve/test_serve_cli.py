"""The installed commands: ``megainfer-serve`` as a subprocess (a streaming request in flight
when SIGTERM comes: it finishes within the grace period, the process exits 0 and leaves no
process behind; every deploy mode's settings resolve), and ``megainfer-bench-serve``
against a server (small)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from megainfer.bench import serve_load as bench
from serve_util import ThreadServer, free_port

BIN = os.path.dirname(sys.executable)


def test_sigterm_drains_and_exits_0(tiny_ckpts):
    port = free_port()
    p = subprocess.Popen([os.path.join(BIN, "megainfer-serve"), f"serve.port={port}",
                          f"model.path={tiny_ckpts[('qwen3_moe', 'base')]}",
                          "serve.shutdown_grace_s=20", "hydra.run.dir=.", "hydra.output_subdir=null",
                          "hydra/job_logging=none", "hydra/hydra_logging=none"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        t0 = time.monotonic()
        while " on http://" not in line:  # listening (after the "[serve] ranks:" line)
            line = p.stdout.readline()
            assert line or p.poll() is None, "server exited"
            assert time.monotonic() - t0 < 60
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health").status_code == 200
        got = {}

        def stream():
            with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                    "prompt": "abc", "max_tokens": 40, "ignore_eos": True, "stream": True}) as r:
                got["lines"] = [x for x in r.iter_lines() if x]
        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        t.join(10)
        assert got["lines"][-1] == "data: [DONE]"  # the in-flight request finished
        assert '"finish_reason": "length"' in got["lines"][-2]
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0


def _compose(*overrides):
    from hydra import compose, initialize_config_module
    with initialize_config_module("megainfer.conf", version_base=None):
        return compose("serve", list(overrides))


def test_serve_config_group_and_every_mode_resolves(monkeypatch):
    from megainfer.config import ConfigError
    from megainfer.launch.serve import serve_settings
    job, serve = serve_settings(_compose("serve.port=0", "serve.api_key=x"))
    assert (job.deploy.mode, serve.host, serve.port, serve.api_key) == ("single", "127.0.0.1",
                                                                        0, "x")
    monkeypatch.setenv("PMI_SIZE", "3")  # rank 0 of mpiexec -n 3 (served: test_serve_modes)
    monkeypatch.setenv("PMI_RANK", "0")
    job, _ = serve_settings(_compose("deploy=a1e2"))
    assert (job.deploy.mode, job.deploy.expert_ranks) == ("disaggregated", 2)
    monkeypatch.setenv("PMI_SIZE", "1")
    with pytest.raises(ConfigError, match="serve.port=-1"):
        serve_settings(_compose("serve.port=-1"))
    with pytest.raises(ConfigError, match="serve.colour"):
        serve_settings(_compose("+serve.colour=red"))


def test_the_ranks_tree_keeps_the_seed_and_not_the_offline_job(monkeypatch):
    """What a plain megainfer-serve's child job resolves: sampling.seed (requests without
    their own seed) and every group but the offline job's; deploy=auto plans from the same tree
    in the frontend and on the ranks (here: the same split of 4 ranks)."""
    from megainfer.engine.resolve import JobTree
    from megainfer.engine.job_doors import serve_tree
    from megainfer.engine.job_doors import settings_from_config
    c, _ = serve_tree(_compose("sampling.seed=7", "workload=random", "serve.world_size=4"))
    assert c["sampling"] == {"seed": 7} and "workload" not in c and "io" not in c
    rank = JobTree(c, 4).resolve(3, holds_cache=False)
    assert rank.seed == 7
    assert settings_from_config(c, 4, 4, 0, holds_cache=False).deploy == rank.deploy


def test_bench_serve_against_the_server(tiny_ckpts, tmp_path, capsys):
    s = ThreadServer(tiny_ckpts[("qwen3_moe", "base")], llm_kw=dict(
        max_model_len=128, max_num_seqs=8, num_blocks=128, block_size=4))
    try:
        rc = bench.main(["--base-url", s.url, "--model", "tiny", "--random-input-len", "8",
                         "--random-output-len", "6", "--num-prompts", "12", "--request-rate",
                         "40", "--max-concurrency", "4", "--ignore-eos", "--goodput",
                         "ttft:60000", "tpot:60000", "--metric-percentiles", "50,99",
                         "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
                         "--result-dir", str(tmp_path), "--result-filename", "r.json",
                         "--disable-tqdm"])
    finally:
        s.close()
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99 TTFT (ms):" in out
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["completed"] == 12 and d["total_output_tokens"] == 72
    assert d["request_goodput"] == pytest.approx(d["request_throughput"])
    assert 0 < d["p50_ttft_ms"] <= d["p99_ttft_ms"] and d["median_itl_ms"] > 0
