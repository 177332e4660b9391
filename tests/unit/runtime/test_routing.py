"""Requests over attention replicas (megainfer/runtime/replicas/request_router.py, ``scheduler.routing``): the
router's longest-prefix choice, load skip, bounded hand-out and rotation; the block manager's
key events; and under mpiexec, 2 attention replicas with round-robin and cache-aware routing,
prefix caching off and on (with a second tier), preemption forced: the greedy tokens of single
mode every time."""
import json
import os
import sys

import pytest

from megainfer.config import ConfigError, SchedulerConfig
from megainfer.engine import SamplingParams
from megainfer.engine.block_manager import BlockManager, hash_block_tokens
from megainfer.engine.request import Request
from megainfer.runtime.replicas.request_router import RequestRouter
from repo_paths import MPI_PROGS

HERE = os.path.dirname(__file__)


def _keys(tokens, bs=2):
    keys = []
    for i in range(len(tokens) // bs):
        keys.append(hash_block_tokens(keys[-1] if keys else None, tokens[i * bs:(i + 1) * bs]))
    return keys


def _router(A=3, policy="cache_aware", max_num_seqs=8, **kw):
    return RequestRouter(A, policy, 2, max_num_seqs, lambda inp: inp, **kw)


def test_longest_cached_prefix_wins():
    r = _router()
    r.update(1, 1, 1, [(k, 1) for k in _keys([1, 2, 3, 4])])  # 2 blocks
    r.update(2, 0, 0, [(k, 1) for k in _keys([1, 2])])  # 1 block, shorter queue
    r.add([[1, 2, 3, 4, 5]])
    assert r.route() == [[], [[1, 2, 3, 4, 5]], []] and r.matched_blocks == 2
    # never the last token: a 4-token prompt can use 1 block; shortest queue among equals
    r.add([[1, 2, 3, 4]])
    assert r.route()[2] == [[1, 2, 3, 4]]
    r.add([[9, 9, 9]])  # no match anywhere: the shortest queue (replica 0)
    assert r.route()[0] == [[9, 9, 9]]


def test_a_much_longer_queue_is_skipped():
    r = _router(balance_abs=2)
    r.update(1, 3, 4, [(k, 1) for k in _keys([1, 2, 3, 4])])  # queue 7: holds the prefix
    r.update(2, 1, 1, [(k, 1) for k in _keys([1, 2])])  # queue 2
    r.update(0, 0, 0)
    r.add([[1, 2, 3, 4, 5]])
    assert r.route()[2] == [[1, 2, 3, 4, 5]]  # 7 > 0 + 2: replica 1 skipped; 2 has 2 <= 0 + 2
    r2 = _router(balance_abs=8)
    r2.update(1, 3, 4, [(k, 1) for k in _keys([1, 2, 3, 4])])
    r2.add([[1, 2, 3, 4, 5]])
    assert r2.route()[1] == [[1, 2, 3, 4, 5]]  # within the threshold: the cache wins


def test_hand_out_is_bounded_and_resumes():
    r = _router(A=2, policy="round_robin", max_num_seqs=2, slack=1)  # room: queue < 3
    r.add([[i, i] for i in range(10)])
    share = r.route()
    assert [len(s) for s in share] == [3, 3] and len(r.pending) == 4
    assert share[0] == [[0, 0], [2, 2], [4, 4]]  # rotation
    assert [len(s) for s in r.route()] == [0, 0]  # nothing reported: still full
    r.update(0, 0, 2)  # replica 0: one finished, one admitted
    assert [len(s) for s in r.route()] == [1, 0] and r.assigned == [4, 3]


def test_same_new_prefix_follows_the_first_request():
    """Requests of a new system prompt arriving together: the first one's blocks are expected
    on its replica, the others follow (round robin spreads them)."""
    sys_prompt = [5, 6, 7, 8, 9, 10]
    reqs = [sys_prompt + [20 + i] for i in range(4)] + [[1, 2, 3, 4, 30 + i] for i in range(4)]
    ca, rr = _router(A=2), _router(A=2, policy="round_robin")
    for r in (ca, rr):
        r.add(reqs)
    a, b = ca.route(), rr.route()
    assert {len(s) for s in a} == {4} and all(len({tuple(x[:4]) for x in s}) == 1 for s in a)
    assert all(len({tuple(x[:4]) for x in s}) == 2 for s in b)
    assert ca.matched_blocks > 0 and rr.matched_blocks == 0


def test_expected_keys_expire_and_events_count_both_tiers():
    r = _router(A=2, expect_iters=2)
    r.add([[1, 2, 3, 4, 5]])
    r.route()
    v = r.replicas[0]
    assert all(v.has(k) for k in _keys([1, 2, 3, 4]))
    for _ in range(3):
        r.route()
    assert not v.expected  # never reported: forgotten
    k = _keys([1, 2])[0]
    r.update(0, 0, 0, [(k, 1), (k, 1), (k, -1)])  # in the first tier and the second, lost one
    assert v.has(k)
    r.update(0, 0, 0, [(k, -1)])
    assert not v.has(k)


def test_block_manager_reports_key_events():
    bm = BlockManager(4, 2, True)
    assert bm.take_key_events() == []  # not tracking: nothing kept
    bm.track_keys()
    req = Request(0, "r", None, [1, 2, 3, 4, 5], SamplingParams(), seed=0)
    assert bm.allocate(req, 5)
    req.num_computed_tokens = 5
    bm.cache_full_blocks(req)
    ks = _keys([1, 2, 3, 4])
    assert bm.take_key_events() == [(ks[0], 1), (ks[1], 1)] and bm.take_key_events() == []
    bm.free_request(req)
    other = Request(1, "o", None, [7] * 8, SamplingParams(), seed=0)
    assert bm.allocate(other, 8)  # evicts both cached blocks (newest-last order)
    assert sorted(bm.take_key_events()) == sorted([(ks[0], -1), (ks[1], -1)])


def test_config_routing_key():
    from hydra import compose, initialize_config_module

    from megainfer.engine.job_doors import settings_from_config
    assert SchedulerConfig().routing == "cache_aware"
    with pytest.raises(ConfigError, match="scheduler.routing"):
        SchedulerConfig(routing="random")
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("config", overrides=["scheduler.routing=round_robin"])
    assert settings_from_config(cfg, 1).scheduler.routing == "round_robin"


# ------------------------------------------------------------------ mpiexec

@pytest.mark.parametrize("A,E", [(2, 1), (2, 0)], ids=["a2e1", "colocated2"])
def test_routing_keeps_single_mode_tokens(tiny_ckpts, tmp_path, A, E):
    from mpi_util import run_mpi
    sys.path.insert(0, MPI_PROGS)
    from runtime_job import shared_reference

    ckpt = tiny_ckpts[("qwen3_moe", "base")]
    want, _ = shared_reference(ckpt, 12)
    out = tmp_path / "out.json"
    run_mpi(A + E, os.path.join(MPI_PROGS, "routing_job.py"), [out, A, E, ckpt, 12],
            timeout=600)
    got = json.loads(out.read_text())
    print({k: {x: v[x] for x in ("cached", "assigned", "matched", "preemptions", "tier_loaded")}
           for k, v in got.items()})
    assert len(got) == 4
    for name, r in got.items():
        assert r["tokens"] == want, name
        assert sum(r["assigned"]) == 12 and min(r["assigned"]) > 0, name  # both replicas work
    assert got["round_robin|caching=1"]["preemptions"] > 0  # the pool forces preemption
    assert got["round_robin|caching=1"]["tier_loaded"] > 0  # and the second tier serves
    assert got["cache_aware|caching=0"]["cached"] == 0 and got["cache_aware|caching=1"]["matched"] > 0
    assert got["cache_aware|caching=1"]["cached"] >= got["round_robin|caching=1"]["cached"] > 0
