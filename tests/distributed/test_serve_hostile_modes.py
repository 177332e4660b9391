"""A plain ``megainfer-serve deploy=a1e2`` / ``p1a1e2`` (the frontend here, the ranks its child
job) under
hostile and careless input: each abusive request gets its OpenAI-shaped 4xx, and after it a
normal greedy request returns the same text as before and /health is 200; n at the limit keeps
every engine iteration under 2.5 s; the child job's sockets listen on loopback only."""
import os
import re
import subprocess

import httpx
import pytest

from serve_util import MpiServe, post_json

OVERRIDES = ["scheduler.max_model_len=128", "scheduler.max_num_seqs=4",
             "scheduler.max_num_batched_tokens=32", "cache.num_blocks=200", "cache.block_size=4",
             "serve.max_n=8", "serve.max_body_bytes=65536", "serve.api_key=k",
             "serve.max_queued_requests=12", "serve.served_model_name=tiny"]
H = {"Authorization": "Bearer k"}
NORMAL = {"prompt": "abcdef", "max_tokens": 6, "temperature": 0}
ABUSE = [  # (body: dict or raw JSON text, headers, status, param)
    ({"prompt": "Hi", "n": 20000, "max_tokens": 1}, H, 400, "n"),
    ({"prompt": ["a", "b"], "n": 8, "max_tokens": 1}, H, 400, None),  # 16 > 12 sequences
    ('{"prompt": "a\\ud800b"}', H, 400, "prompt"),
    ('{"prompt": "a", "temperature": Infinity}', H, 400, "temperature"),
    ({"prompt": [[False]]}, H, 400, "prompt"),
    ({"prompt": "x" * 70_000}, H, 413, None),
    ("{not json", {}, 401, None),
    ({"prompt": "x" * 60_000, "max_tokens": 1}, H, 400, "prompt"),
]


def _post(url, body, headers, path="/v1/completions"):
    return post_json(url, body, headers, path, timeout=60)


@pytest.fixture(scope="module", params=["a1e2", "p1a1e2"])
def srv(tiny_ckpts, request):
    s = MpiServe(None, [f"deploy={request.param}", f"model.path={tiny_ckpts[('mixtral', 'base')]}",
                        *OVERRIDES])
    yield s
    s.close()


def test_abusive_requests_are_refused_and_the_server_serves_on(srv):
    normal = _post(srv.url, NORMAL, H).json()["choices"][0]["text"]
    for body, headers, status, param in ABUSE:
        r = _post(srv.url, body, headers)
        assert r.status_code == status, (body if isinstance(body, str) else list(body), r.text)
        e = r.json()["error"]
        assert set(e) == {"message", "type", "param", "code"}
        assert e["code"] is None or isinstance(e["code"], str)
        if param is not None:
            assert e["param"].split(".")[0] == param, e
        assert httpx.get(srv.url + "/health").status_code == 200
        assert _post(srv.url, NORMAL, H).json()["choices"][0]["text"] == normal
    r = _post(srv.url, {"prompt": "abc", "echo": True, "max_tokens": 0}, H).json()
    assert r["choices"][0]["text"] == "abc"
    r = _post(srv.url, {"prompt": "abc", "max_tokens": 8, "min_tokens": 6, "ignore_eos": False,
                        "temperature": 0}, H).json()
    assert r["usage"]["completion_tokens"] >= 6


def test_n_at_the_limit_keeps_every_iteration_short(srv):
    r = _post(srv.url, {"prompt": "Hi", "n": 8, "max_tokens": 8, "temperature": 1, "seed": 1}, H)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
    m = httpx.get(srv.url + "/metrics", headers=H).text
    under = float(re.search(r'iteration_time_seconds_bucket\{le="2.5"[^}]*\} (\S+)', m).group(1))
    count = float(re.search(r"iteration_time_seconds_count\{[^}]*\} (\S+)", m).group(1))
    assert count > 0 and under == count
    assert httpx.get(srv.url + "/health").status_code == 200


def _tree(pid: int) -> set[int]:
    """``pid`` and every process below it (``/proc``)."""
    parent = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += [c for c, pp in parent.items() if pp == p and c not in out]
    return out


def _listening(pids) -> list[str]:
    """The TCP addresses the processes ``pids`` listen on (``ss``), but MPICH's process
    manager's own PMI port (held by ``mpiexec``: hydra binds it on every interface)."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines()
            if any(f"pid={p}," in line for p in pids) and '("mpiexec",' not in line]


@pytest.mark.skipif(subprocess.run(["which", "ss"], capture_output=True).returncode != 0,
                    reason="needs ss (iproute2)")
def test_the_child_job_listens_on_loopback_only(srv):
    addrs = _listening(_tree(srv.proc.pid))  # the frontend, mpiexec, its proxy, the ranks
    assert addrs, "no listening socket found"
    assert all(a.startswith(("127.", "[::1]", "localhost")) for a in addrs), addrs
