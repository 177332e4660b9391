"""The device side of the comm layer, on CPU: the staging transport (run with CPU tensors under
real mpiexec), capacity checks, the transport choice and its failure messages, the leader's
rows per expert rank, colocated mode's grouped posts, and that nothing CUDA is touched on a
CPU box. The CUDA-only parts are in tests/gpu/test_runtime_gpu.py (marked gpu)."""
import json
import os

import pytest
import torch

from megainfer.comm import M2N, LoopbackFabric, combine_spec, dispatch_spec
from megainfer.comm.loopback import LoopbackTransport
from megainfer.comm.cuda_ipc import check_cuda_ipc
from megainfer.comm.errors import TransportChoiceError
from megainfer.comm.select import check_nccl, pair_plan, resolve, shared_gpus
from megainfer.config import CommConfig, ConfigError
from megainfer.runtime.pipeline.exchange import AttentionExchange, ExpertExchange, rows_per_rank
from megainfer.runtime.trace import Tracer
from mpi_util import run_mpi

PROG = os.path.join(os.path.dirname(__file__), "mpi_progs", "device_roundtrip.py")
CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU
CPU = torch.device("cpu")


@pytest.mark.parametrize("n", [2, 3])
def test_staging_transport_round_trips_exactly_on_cpu_tensors(tmp_path, n):
    """StagingTransport with CPU 'device' buffers: both layouts (colocated: self-peers), 0..80
    rows (past the 64 persistent sends a slot keeps), one message over capacity refused."""
    out = tmp_path / "out.json"
    run_mpi(n, PROG, ["staging", "cpu", out], timeout=240)
    got = json.loads(out.read_text())
    per_layout = 12 * 2 * 2  # iterations x layers x micro-batches
    assert got["transport"] == "StagingTransport" and got["too_large"] is True
    assert got["ok"] == 2 * per_layout * (n - 1) + 2 * per_layout * n * n


def test_staging_buffers_keep_device_data_apart_from_the_host_mirror():
    from mpi4py import MPI  # noqa: F401 (a singleton communicator in this process)
    from megainfer.comm.staging import StagingTransport
    t = StagingTransport(MPI.COMM_SELF, "cpu")
    buf = t.alloc(96)
    assert buf.data.data_ptr() != buf.extra["host"].data_ptr()
    assert buf.header.ctypes.data == buf.extra["host"].data_ptr()  # header = mirror's 32 bytes
    t.close()


def test_transport_choice():
    one, two = ["n0"] * 3, ["n0", "n0", "n1"]
    assert resolve("auto", CPU, one, [""] * 3) == "mpi"
    assert resolve("mpi", CUDA, one, ["g0"] * 3) == "mpi"
    assert resolve("auto", CUDA, one, ["g0", "g0", "g1"]) == "cuda_ipc"
    assert resolve("auto", CUDA, two, ["g0", "g1", "g0"]) == "nccl"
    assert set(pair_plan(one).values()) == {"cuda_ipc"} and set(pair_plan(two).values()) == {"nccl"}
    assert len(pair_plan(two)) == 9
    for kind in ("cuda_ipc", "nccl"):
        with pytest.raises(TransportChoiceError, match=f"comm.transport={kind}: moves device"):
            resolve(kind, CPU, one, [""] * 3)
    with pytest.raises(TransportChoiceError, match="must be one of"):
        resolve("ucx", CUDA, one, ["g0"] * 3)


def test_failures_name_ranks_and_reason():
    with pytest.raises(TransportChoiceError, match=r"one node.*n0 \(ranks \[0, 1\]\).*n1 \(ranks \[2\]\)"):
        check_cuda_ipc(["n0", "n0", "n1"])
    check_cuda_ipc(["n0", "n0"])
    hosts, gpus = ["n0", "n0", "n0"], ["0000:19:00.0", "0000:19:00.0", "0000:3b:00.0"]
    assert shared_gpus(hosts, gpus) == [("n0", "0000:19:00.0", [0, 1])]
    with pytest.raises(TransportChoiceError, match=r"ranks \[0, 1\] on GPU 0000:19:00.0 of n0"):
        check_nccl(hosts, gpus, 22809, env={})
    with pytest.raises(TransportChoiceError, match="needs NCCL >= 2.30"):
        check_nccl(hosts, gpus, 22809, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    check_nccl(hosts, gpus, 23000, env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"})  # tried, not refused
    check_nccl(hosts, ["a", "b", "c"], 22809, env={})


def test_comm_config_takes_the_device_transports():
    for kind in ("auto", "mpi", "cuda_ipc", "nccl"):
        assert CommConfig(transport=kind).transport == kind
    assert CommConfig().transport == "auto"
    with pytest.raises(ConfigError, match="comm.transport='gloo'"):
        CommConfig(transport="gloo")


def test_rows_per_rank_matches_a_host_scan():
    g = torch.Generator().manual_seed(3)
    for n, ranks in ((0, 3), (1, 1), (37, 4), (64, 2)):
        owner = torch.randint(0, ranks, (n, 2), generator=g)
        got = rows_per_rank(owner, ranks)
        for j in range(ranks):
            want = (owner == j).any(dim=1).nonzero().flatten()
            assert torch.equal(got[j], want), (n, ranks, j)


class _Recording(LoopbackTransport):
    """Loopback that posts like NCCL (ordered, at recv()) and records whether each send and
    receive was issued inside a group."""

    ordered_posts = True

    def __init__(self, fabric, rank):
        super().__init__(fabric, rank)
        self.depth, self.ops = 0, []

    def group(self):
        t = self

        class G:
            def __enter__(self):
                t.depth += 1

            def __exit__(self, *exc):
                t.depth -= 1
        return G()

    def isend(self, buf, nbytes, peer, tag):
        self.ops.append(("send", self.depth > 0))
        return super().isend(buf, nbytes, peer, tag)

    def irecv(self, buf, nbytes, peer, tag):
        self.ops.append(("recv", self.depth > 0))
        return super().irecv(buf, nbytes, peer, tag)


def test_colocated_exchange_groups_each_channels_sends_with_its_receives():
    """On NCCL a rank that sends and receives on one communicator must issue both in one group
    (a posted receive holds the stream): colocated mode's exchange does, and the sums are right."""
    fab = LoopbackFabric(1)
    t = fab.endpoints[0] = _Recording(fab, 0)
    H, k = 8, 2
    m2n = M2N((t, t), [0], [0], dispatch_spec(16, H, k, torch.float32),
              combine_spec(16, H, torch.float32))
    expert = ExpertExchange(m2n)
    attn = AttentionExchange(m2n, torch.zeros(4, dtype=torch.long), partner=expert)
    x = torch.randn(5, H)
    ids, w = torch.randint(0, 4, (5, k)), torch.rand(5, k)
    for layer in range(3):
        flight = attn.dispatch(0, layer, 0, x, ids, w)
        (h, got_ids, got_w), = expert.receive(0, layer, 0)
        assert torch.equal(h, x) and torch.equal(got_ids.long(), ids)
        expert.reply(0, layer, 0, [h * 3])
        assert torch.equal(attn.combine(flight), x * 3)
    assert t.ops and all(in_group for _, in_group in t.ops), t.ops
    assert {op for op, _ in t.ops} == {"send", "recv"}


def test_tracer_on_cpu_and_a_disabled_cuda_tracer_touch_no_gpu():
    tr = Tracer(enabled=True, device="cpu")
    with tr.span("attention", "a", 0, 0, 0, 1):
        pass
    assert not tr.cuda and tr.events[-1]["dur"] >= 0
    assert not Tracer(enabled=False, device=CUDA).cuda  # no CUDA event made


def test_cudart_is_looked_up_lazily():
    from megainfer.comm import cudart
    assert any("libcudart" in c for c in cudart.candidates())
    if not torch.cuda.is_available():
        with pytest.raises(cudart.CudaUnavailableError, match="no CUDA device"):
            cudart.runtime()


def test_ipc_handle_keeps_all_64_bytes_zeros_included():
    """CUDA IPC handles hold zero bytes; reading the ctypes char-array field would cut them at
    the first one (the bug the first H200 run found: 2- and 4-byte handles)."""
    from megainfer.comm.cudart import IPC_HANDLE_BYTES, IpcHandle
    want = bytes([0x7F, 0x02, 0, 0, 0x10] + [0] * 50 + list(range(1, 10)))
    h = IpcHandle.from_buffer_copy(want)
    assert len(want) == IPC_HANDLE_BYTES and h.raw() == want
    assert IpcHandle.from_buffer_copy(h.raw()).raw() == want


def _settings(*overrides, world=1):
    from hydra import compose, initialize_config_module
    from megainfer.engine.job_doors import settings_from_config
    with initialize_config_module(config_module="megainfer.conf", version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return settings_from_config(cfg, world)


def test_distributed_modes_take_deploy_device_cuda():
    """No longer refused for being distributed: on a GPU box it resolves, on a CPU box the
    refusal is the missing GPU; auto stays cpu for distributed modes, transport auto -> mpi."""
    s = _settings("deploy=a1e2", world=3)
    assert s.device.device == "cpu" and s.comm.transport == "auto"
    if torch.cuda.is_available():
        assert _settings("deploy=a1e2", "deploy.device=cuda", world=3).device.device == "cuda"
    else:
        with pytest.raises(ConfigError, match="no CUDA device") as e:
            _settings("deploy=a1e2", "deploy.device=cuda", world=3)
        assert "distributed" not in str(e.value)


def test_calibration_takes_the_link_from_the_transport_bench(tmp_path):
    from megainfer.calibration.calibrate import transport_link
    rows = [{"method": "cuda_ipc", "bytes": b, "one_way_p50_us": 10 + b / 100e3}
            for b in (2048, 65536, 8 << 20)]
    rows.append({"method": "mpi", "bytes": 2048, "one_way_p50_us": 1.0})
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"rows": rows}))
    link = transport_link(str(p))
    assert link["latency_s"] == pytest.approx(10.02048e-6)
    assert link["bandwidth_Bps"] == pytest.approx(100e9, rel=1e-6)
    p.write_text(json.dumps({"rows": rows[-1:]}))
    with pytest.raises(ConfigError, match="no cuda_ipc rows"):
        transport_link(str(p))


class _FakeRuntime:
    """libcudart stand-in over host memory: copies are memmoves, events complete at once. Lets
    the cuda_ipc protocol (rings, grants, queued sends, headers over MPI, self-peers) run on a
    CPU box in one process; the CUDA calls themselves are checked on a GPU."""

    def __init__(self, slow=False):
        self.keep, self.n, self.copies = [], 0, 0
        self.slow, self.queries = slow, 0  # slow: every other completion query says not yet

    def alloc(self, nbytes):
        a = (__import__("ctypes").c_uint8 * nbytes)()
        self.keep.append(a)
        return __import__("ctypes").addressof(a)

    def ipc_event(self):
        self.n += 1
        return 1000 + self.n

    def eventCreateWithFlags(self, ref, flags):
        self.n += 1
        ref._obj.value = 1000 + self.n
        return 0

    def memcpyAsync(self, dst, src, n, kind, stream):
        __import__("ctypes").memmove(dst.value, src.value, n)
        self.copies += 1
        return 0

    def check(self, rc, what):
        assert rc == 0, what

    def done(self, ev):
        self.queries += 1
        return not (self.slow and self.queries % 2)

    eventRecord = streamWaitEvent = lambda self, *a: 0
    free = eventDestroy = ipcCloseMemHandle = lambda self, *a: 0


@pytest.mark.parametrize("sync", ["device", "host"])
def test_cuda_ipc_protocol_on_a_fake_runtime(monkeypatch, sync):
    """Self-peer rings over CudaIpcTransport with host memory: messages arrive intact, a send
    whose grant has not come is queued and issued once the receiver re-posts the slot.
    Host-fenced: headers and grants wait for their events, which complete late here."""
    import ctypes
    import numpy as np
    from mpi4py import MPI
    from megainfer.comm import cuda_ipc, ipc_slots
    rt = _FakeRuntime(slow=sync == "host")
    monkeypatch.setattr(cuda_ipc, "runtime", lambda: rt)
    monkeypatch.setattr(ipc_slots, "_cur", lambda device: ctypes.c_void_p(0))
    monkeypatch.setattr(cuda_ipc, "device_tensor", lambda ptr, n, dev: torch.from_numpy(
        np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    t = cuda_ipc.CudaIpcTransport(MPI.COMM_SELF, "cpu", sync=sync)
    assert t.host_sync == (sync == "host")
    H, k = 8, 2
    m2n = M2N((t, t), [0], [0], dispatch_spec(16, H, k, torch.float32),
              combine_spec(16, H, torch.float32), micro_batches=1, depth=2)
    g = torch.Generator().manual_seed(0)

    def msg(i):
        n = i % 5
        return dict(hidden=torch.randn(n, H, generator=g), topk_ids=torch.full((n, k), i, dtype=torch.int32),
                    topk_weights=torch.rand(n, k, generator=g))
    sent = [msg(i) for i in range(3)]
    m2n.a2e.send(0, iteration=0, layer=0, micro_batch=0, **sent[0])
    m2n.a2e.send(0, iteration=0, layer=1, micro_batch=0, **sent[1])
    t.progress()
    t.progress()  # host-fenced: the grants of the first posts go once their events completed
    assert t._queued == 0  # two grants from the receive ring's first posts
    got = m2n.a2e.recv(0, layer=0, micro_batch=0, iteration=0).wait()
    assert all(torch.equal(got[f], sent[0][f]) for f in sent[0])
    got.release()
    m2n.a2e.send(0, iteration=0, layer=2, micro_batch=0, **sent[2])
    assert t._queued == 1  # slot 0 is released but not re-posted: no grant yet
    for layer in (1, 2):
        got = m2n.a2e.recv(0, layer=layer, micro_batch=0, iteration=0).wait()
        assert got.rows == sent[layer]["hidden"].shape[0]
        assert all(torch.equal(got[f], sent[layer][f]) for f in sent[layer]), layer
        got.release()
    assert t._queued == 0 and rt.copies == 2  # (message 0 has no rows: nothing to copy)
    if sync == "host":
        assert rt.queries > 1  # headers and grants waited on completions (half said not yet)
    for it in range(4):  # combine direction, and many laps of the rings
        m2n.e2a.send(0, iteration=it, layer=0, micro_batch=0, out=torch.full((3, H), float(it)))
        out = m2n.e2a.recv(0, layer=0, micro_batch=0, iteration=it).wait()
        assert torch.equal(out["out"], torch.full((3, H), float(it)))
        out.release()
    m2n.close()
    t.close()
