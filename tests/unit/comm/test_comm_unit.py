"""Unit tests of the M2N layer on the in-process loopback transport (no MPI, no threads
unless stated)."""
import threading

import pytest
import torch

from megainfer.comm import (KIND_DATA, KIND_REBALANCE, KIND_STOP, M2N, Channel,
                            CommError, CommProtocolError, CommTimeoutError, LoopbackFabric,
                            MessageSpec, MessageTooLargeError, WaitPolicy, combine_spec,
                            dispatch_spec, make_transports)
from megainfer.comm.spec import HEADER_BYTES, MessageLayout, alloc_nbytes
from megainfer.comm.wait import wait_until
from megainfer.config import ConfigError

H, K = 8, 2
FAST = WaitPolicy(timeout_s=0.2)


def tokens(n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g).to(dtype)                                    # [n, H]
    ids = torch.randint(0, 16, (n, K), generator=g, dtype=torch.int32)              # [n, k]
    w = torch.rand(n, K, generator=g)                                               # [n, k]
    return dict(hidden=h, topk_ids=ids, topk_weights=w)


def pair(cap=4, streams=1, depth=2, wait=FAST, senders=(0,), receivers=(1,), size=2):
    fab = LoopbackFabric(size)
    spec = dispatch_spec(cap, H, K, torch.float32)
    chans = [Channel(fab.endpoint(r), list(senders), list(receivers), spec, streams=streams,
                     depth=depth, wait=wait) for r in range(size)]
    return fab, chans


def test_spec_layout_is_compact_and_aligned():
    spec = dispatch_spec(10, H, K, torch.bfloat16)
    assert spec.nbytes(0) == HEADER_BYTES
    offs = spec.offsets(3)  # hidden 3*8*2=48 B, ids 3*2*4=24 B -> 32 aligned, weights 24 -> 32
    assert offs == [32, 80, 112] and spec.nbytes(3) == 144
    assert all(o % 16 == 0 for o in spec.offsets(7))
    buf = torch.zeros(alloc_nbytes(spec), dtype=torch.uint8)
    v = MessageLayout(spec, buf).views(3)
    assert v["hidden"].shape == (3, H) and v["hidden"].dtype == torch.bfloat16
    v["topk_ids"].fill_(7)
    assert buf[80:104].view(torch.int32).eq(7).all() and buf[104:112].eq(0).all()


def test_spec_validation_names_the_field():
    with pytest.raises(ConfigError, match="capacity"):
        MessageSpec.of(-1, x=((2,), torch.float32))
    with pytest.raises(ConfigError, match="shape"):
        MessageSpec.of(4, x=((0,), torch.float32))
    with pytest.raises(ConfigError, match="wait.mode"):
        WaitPolicy(mode="busy")
    with pytest.raises(ConfigError, match="streams"):
        pair(streams=0)


def test_roundtrip_several_in_flight_with_empties():
    fab, (tx, rx) = pair(cap=5, depth=3)
    sent = []
    for i, n in enumerate([3, 0, 5]):  # three messages in flight before any receive
        t = tokens(n, seed=i)
        tx.send(1, iteration=9, layer=0, micro_batch=i, **t)
        sent.append(t)
    for i, t in enumerate(sent):
        msg = rx.recv(0, layer=0, micro_batch=i, iteration=9).wait()
        assert msg.header.kind == KIND_DATA and msg.rows == t["hidden"].shape[0]
        assert (msg.header.iteration, msg.header.layer, msg.header.micro_batch) == (9, 0, i)
        for k, v in t.items():
            assert torch.equal(msg[k], v)
        msg.release()


def test_ring_reuse_keeps_order_over_many_messages():
    fab, (tx, rx) = pair(cap=4, depth=2, streams=2)
    for it in range(50):
        hs = [tx.send(1, iteration=it, layer=1, micro_batch=mb, **tokens(it % 5, seed=it * 2 + mb))
              for mb in range(2)]
        for mb in range(2):
            msg = rx.recv(0, layer=1, micro_batch=mb, iteration=it).wait()
            assert torch.equal(msg["hidden"], tokens(it % 5, seed=it * 2 + mb)["hidden"])
            msg.release()
        for h in hs:
            h.wait()


def test_too_many_rows_is_an_error_not_a_truncation():
    fab, (tx, rx) = pair(cap=4)
    with pytest.raises(MessageTooLargeError, match="5 rows exceed the channel capacity of 4"):
        tx.send(1, iteration=0, layer=0, micro_batch=0, **tokens(5))
    assert isinstance(MessageTooLargeError("x"), ValueError)


def test_bad_fields_name_the_field():
    fab, (tx, rx) = pair()
    t = tokens(2)
    t["topk_ids"] = t["topk_ids"].long()
    with pytest.raises(ValueError, match="topk_ids"):
        tx.send(1, iteration=0, layer=0, micro_batch=0, **t)
    t = tokens(2)
    del t["topk_weights"]
    with pytest.raises(ValueError, match="missing field 'topk_weights'"):
        tx.send(1, iteration=0, layer=0, micro_batch=0, **t)


def test_receive_timeout_names_peer_layer_microbatch_iteration():
    fab, (tx, rx) = pair(wait=WaitPolicy(timeout_s=0.05))
    with pytest.raises(CommTimeoutError) as ei:
        rx.recv(0, layer=4, micro_batch=2, iteration=11).wait()
    e = ei.value
    assert (e.peer, e.layer, e.micro_batch, e.iteration) == (0, 4, 2, 11)
    assert "peer rank 0" in str(e) and "layer=4" in str(e) and "micro_batch=2" in str(e)
    assert isinstance(e, RuntimeError)


def test_stream_mismatch_is_detected():
    fab, (tx, rx) = pair()
    tx.send(1, iteration=3, layer=1, micro_batch=0, **tokens(1))
    with pytest.raises(CommProtocolError, match="expected .iteration=3, layer=2"):
        rx.recv(0, layer=2, micro_batch=0, iteration=3).wait()


def test_control_messages_share_the_stream():
    fab, (tx, rx) = pair()
    tx.send(1, iteration=0, layer=0, micro_batch=0, **tokens(2))
    tx.send_control(1, KIND_REBALANCE, iteration=0, layer=1, micro_batch=0, aux=42)
    tx.send_control(1, KIND_STOP, iteration=1, layer=0, micro_batch=0)
    kinds = []
    for layer in range(3):
        msg = rx.recv(0, layer=layer % 2, micro_batch=0).wait()
        kinds.append((msg.kind, msg.header.aux, msg.rows))
        msg.release()
    assert kinds == [(KIND_DATA, 0, 2), (KIND_REBALANCE, 42, 0), (KIND_STOP, 0, 0)]


def test_unreleased_ring_is_an_error():
    fab, (tx, rx) = pair(depth=1)
    tx.send(1, iteration=0, layer=0, micro_batch=0, **tokens(1))
    rx.recv(0, layer=0, micro_batch=0).wait()  # not released
    with pytest.raises(CommError, match="release"):
        rx.recv(0, layer=1, micro_batch=0)


def test_not_a_pair_is_an_error():
    fab, (tx, rx) = pair()
    with pytest.raises(CommError, match="not a sender->receiver pair"):
        rx.send(0, iteration=0, layer=0, micro_batch=0, **tokens(1))


def test_wait_policies_all_complete_and_time_out():
    for mode in ("spin", "yield", "backoff"):
        pol = WaitPolicy(mode=mode, timeout_s=0.05)
        calls = iter(range(1000))
        assert wait_until(lambda: next(calls) >= 30, pol) >= 0
        assert wait_until(lambda: False, pol) < 0


def test_m2n_threads_2x2_pingpong():
    """Four fake ranks on threads: attention 0,1 and experts 2,3, m=2 micro-batches, 2 layers."""
    fab = LoopbackFabric(4)
    specs = (dispatch_spec(6, H, K, torch.float32), combine_spec(6, H, torch.float32))
    links = [M2N(make_transports("loopback", fabric=fab, rank=r), [0, 1], [2, 3], *specs,
                 micro_batches=2, wait=WaitPolicy(timeout_s=20)) for r in range(4)]
    errors, iters = [], 20

    def key(it, layer, mb, a, e):
        return ((it * 7 + layer * 5 + mb * 3 + a * 11 + e) % 7, it * 100 + layer * 10 + mb + a + e)

    def attn(me):
        link = links[me]
        for it in range(iters):
            for layer in range(2):
                for mb in range(2):
                    for e in (2, 3):
                        n, seed = key(it, layer, mb, me, e)
                        link.a2e.send(e, iteration=it, layer=layer, micro_batch=mb, **tokens(n, seed))
                for mb in range(2):
                    for e in (2, 3):
                        msg = link.e2a.recv(e, layer=layer, micro_batch=mb, iteration=it).wait()
                        n, seed = key(it, layer, mb, me, e)
                        assert torch.equal(msg["out"], tokens(n, seed)["hidden"] * e)
                        msg.release()
        link.stop(iteration=iters, layer=0, micro_batch=0)

    def expert(me):
        link, it = links[me], 0
        while True:
            for layer in range(2):
                for mb in range(2):
                    for a in (0, 1):
                        msg = link.a2e.recv(a, layer=layer, micro_batch=mb, iteration=it).wait()
                        if msg.kind == KIND_STOP:
                            return
                        link.e2a.send(a, iteration=it, layer=layer, micro_batch=mb, out=msg["hidden"] * me)
                        msg.release()
            it += 1

    def guard(fn, r):
        try:
            fn(r)
        except BaseException as e:  # surfaced below
            errors.append((r, e))

    ths = [threading.Thread(target=guard, args=(attn if r < 2 else expert, r)) for r in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in ths)


def test_spec_mismatch_is_caught_even_at_equal_size():
    """Sender bf16 [n, 8] and receiver fp16 [n, 8]: same bytes, different spec -> the magic
    word's fingerprint differs and the receiver names the mismatch."""
    fab = LoopbackFabric(2)
    tx = Channel(fab.endpoint(0), [0], [1], MessageSpec.of(4, x=((8,), torch.bfloat16)))
    rx = Channel(fab.endpoint(1), [0], [1], MessageSpec.of(4, x=((8,), torch.float16)))
    assert tx.spec.magic != rx.spec.magic and tx.spec.nbytes(3) == rx.spec.nbytes(3)
    tx.send(1, iteration=0, layer=0, micro_batch=0, x=torch.ones(3, 8, dtype=torch.bfloat16))
    with pytest.raises(CommProtocolError, match="another MessageSpec"):
        rx.recv(0, layer=0, micro_batch=0, iteration=0).wait()


def test_corrupt_header_is_caught():
    fab, (tx, rx) = pair()
    out = tx.reserve(1, 1)
    tx.post(out, iteration=0, layer=0, micro_batch=0)
    ring = rx._recv[0][0]  # [stream][sender]
    ring.slots[0].buf.header[0] = 12345  # the bytes landed already (loopback copies at once)
    with pytest.raises(CommProtocolError, match="corrupt header"):
        rx.recv(0, layer=0, micro_batch=0, iteration=0).wait()


def test_send_handle_stays_done_after_its_slot_is_reused():
    fab, (tx, rx) = pair(depth=1)  # one send slot per peer: every send reuses it
    first = tx.send(1, iteration=0, layer=0, micro_batch=0, **tokens(1))
    rx.recv(0, layer=0, micro_batch=0, iteration=0).wait().release()
    tx.send(1, iteration=1, layer=0, micro_batch=0, **tokens(2))  # same slot, not received
    assert first.test()  # the old handle does not wait on the new message
    first.wait()
    msg = rx.recv(0, layer=0, micro_batch=0, iteration=1).wait()
    assert msg.rows == 2 and torch.equal(msg["hidden"], tokens(2)["hidden"])


def test_receive_first_polls_yield_the_core_unless_the_policy_spins(monkeypatch):
    """With ranks sharing cores, a receive's first polls must let the core go (flat-out
    polls kept the sender on that core from posting); a spin policy still polls flat out."""
    import os
    yields = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))

    class LateRequest:  # the message is complete at the 10th poll, within the fast polls
        def __init__(self):
            self.polls = 0

        def test(self):
            self.polls += 1
            return self.polls >= 10

    for wait, want in ((WaitPolicy(), 9), (WaitPolicy(mode="yield"), 9),
                       (WaitPolicy(mode="spin"), 0), (WaitPolicy(spin_s=1e-3), 0)):
        fab, (tx, rx) = pair(wait=wait)
        tx.send(1, iteration=0, layer=0, micro_batch=0, **tokens(1))
        h = rx.recv(0, layer=0, micro_batch=0, iteration=0)
        h._slot.req = LateRequest()
        yields.clear()
        assert h.wait().rows == 1
        assert len(yields) == want, (wait, len(yields))
    rx.policy = WaitPolicy(mode="yield")  # the channel follows a policy swap
    assert rx._fast_yield


def test_waited_send_handle_frees_its_slot_for_reserve():
    fab, (tx, rx) = pair(depth=1)
    h = tx.send(1, iteration=0, layer=0, micro_batch=0, **tokens(1))
    h.wait()
    slot = h[1]
    assert slot.clear  # known to have left: the next reserve() of it asks nothing
    slot.req = None    # (would raise if reserve() tested it again)
    out = tx.reserve(1, 2)
    assert out is slot and out.rows == 2


def test_a_dropped_channel_is_freed_without_the_cycle_collector():
    """Buffers free at once when the channel goes (no slot -> channel reference cycles), as
    they did when bench configs ran back to back on freed communicators."""
    import gc
    import weakref
    fab, (tx, rx) = pair()
    h = tx.send(1, iteration=0, layer=0, micro_batch=0, **tokens(1))
    rx.recv(0, layer=0, micro_batch=0, iteration=0).wait().release()
    h.wait()
    refs = [weakref.ref(tx), weakref.ref(tx._send[1][0].buf.data)]  # a slot buffer
    gc.disable()
    try:
        del h, tx
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_receive_handle_is_the_message():
    fab, (tx, rx) = pair()
    h = rx.recv(0, layer=0, micro_batch=0, iteration=0)
    assert not h.test()
    tx.send(1, iteration=0, layer=0, micro_batch=0, **tokens(3))
    assert h.test() and h.wait() is h and h.rows == 3 and h.wait() is h
    h.release()
    h.release()  # idempotent


class _FakeClock:
    """Stands in for ``time`` in wait.py: each clock read advances 1 us, a sleep exactly its
    length, so the backoff's schedule is checked without the machine's timing noise."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append((self.now, s))
        self.now += s


def test_backoff_sleep_phase_wakes_soon_after_a_long_wait(monkeypatch):
    """Sleeps double from 1 ms but never exceed 1/8 of the time waited: a 40 ms wait ends by
    ~45 ms (uncapped doubling 1, 2, 4, 8, 16, 32 ms would wake at ~63 ms)."""
    from megainfer.comm import wait as wait_mod
    clock = _FakeClock()
    monkeypatch.setattr(wait_mod, "time", clock)
    pol = WaitPolicy(yield_s=1e-4, min_sleep_s=1e-3, max_sleep_s=1.0, timeout_s=5.0)
    waited = wait_until(lambda: clock.now > 0.04, pol)
    assert 0.04 <= waited < 0.04 * (1 + pol.sleep_frac) + 1e-4, waited
    for at, s in clock.sleeps:  # never more than 1/8 of the time waited so far (t0 ~ 0)
        assert s <= pol.sleep_frac * at + 1e-9, (at, s)
    sleeps = [s for _, s in clock.sleeps]
    assert sleeps == sorted(sleeps) and sleeps[-1] > 4e-3  # they grow with the wait, so a
    assert len(sleeps) < 60                                # 40 ms wait takes ~50 wake-ups
    clock.now = 0.0  # a wait that never ends gives up at its timeout, not a long sleep later
    assert -5.001 < wait_until(lambda: False, pol) < -5.0
    with pytest.raises(ConfigError, match="sleep_frac"):
        WaitPolicy(sleep_frac=0)


def test_an_idle_wait_sleeps_longer_and_wakes_a_few_hundred_times_a_second(monkeypatch):
    """Up to ``idle_after_s`` the sleeps stay within ``max_sleep_s`` (a step's waits keep their
    latency); past it they grow to ``idle_sleep_s``, so 2 s of idling wakes ~500 times, not
    ~2000, and a message after it is seen at most ``idle_sleep_s`` late."""
    from megainfer.comm import wait as wait_mod
    clock = _FakeClock()
    monkeypatch.setattr(wait_mod, "time", clock)
    pol = WaitPolicy(timeout_s=10.0)
    waited = wait_until(lambda: clock.now > 2.0, pol)
    assert 2.0 <= waited < 2.0 + pol.idle_sleep_s + 1e-4, waited
    assert all(s <= pol.max_sleep_s for at, s in clock.sleeps if at < pol.idle_after_s)
    assert max(s for _, s in clock.sleeps) == pytest.approx(pol.idle_sleep_s)
    assert 450 < len(clock.sleeps) < 550, len(clock.sleeps)
    clock.sleeps = []
    busy = WaitPolicy(timeout_s=10.0, idle_after_s=10.0)  # never idle: 1 ms sleeps throughout
    wait_until(lambda: clock.now > 4.0, busy)
    assert len(clock.sleeps) > 1500
    with pytest.raises(ConfigError, match="idle_sleep_s"):
        WaitPolicy(idle_sleep_s=-1)
