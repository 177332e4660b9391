"""NCCL transport: imports on CPU, finds/declares libnccl when present, round-trips a message
through a 1-rank communicator on one GPU when there is one."""
import subprocess
import sys

import pytest
import torch

from megainfer.comm import nccl


def test_import_needs_no_gpu_and_no_library():
    code = "import megainfer.comm.nccl, torch; print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_missing_library_is_a_typed_error():
    with pytest.raises(nccl.NcclUnavailableError, match="libnccl.so.2 not found"):
        nccl.load_nccl("/nonexistent/libnccl.so.2")


def _lib_or_skip():
    try:
        return nccl.load_nccl()
    except nccl.NcclUnavailableError as e:
        pytest.skip(f"libnccl.so.2 not installed (install the nccl extra or set "
                    f"MEGAINFER_NCCL_LIB): {str(e)[:120]}")


def test_library_loads_and_reports_version():
    lib = _lib_or_skip()
    v = nccl.nccl_version(lib)
    assert v >= 2_00_00, v  # e.g. 22703 for 2.27.3
    uid = nccl.NcclUniqueId()
    assert lib.ncclGetUniqueId(__import__("ctypes").byref(uid)) == 0
    assert any(bytes(uid))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_roundtrip_on_one_gpu():
    _lib_or_skip()
    from mpi4py import MPI
    from megainfer.comm import Channel, dispatch_spec
    t = nccl.NcclTransport(MPI.COMM_SELF)
    spec = dispatch_spec(64, 128, 2, torch.bfloat16)
    ch = Channel(t, [0], [0], spec, streams=2, depth=2)
    dev = t.device
    for i, n in enumerate([0, 17, 64, 1, 33]):
        h = torch.randn(n, 128, device=dev).to(torch.bfloat16)                      # [n, H]
        ids = torch.randint(0, 8, (n, 2), device=dev, dtype=torch.int32)           # [n, k]
        w = torch.rand(n, 2, device=dev)                                            # [n, k]
        with ch.group():  # self send/recv must share one NCCL group
            rh = ch.recv(0, layer=i, micro_batch=i % 2, iteration=5)
            sh = ch.send(0, iteration=5, layer=i, micro_batch=i % 2, hidden=h, topk_ids=ids,
                         topk_weights=w)
        msg = rh.wait()
        sh.wait()
        assert msg.rows == n and msg.header.layer == i
        assert msg["hidden"].device.type == "cuda"
        assert torch.equal(msg["hidden"], h) and torch.equal(msg["topk_ids"], ids)
        assert torch.equal(msg["topk_weights"], w)
        msg.release()
    ch.close()
    t.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_posting_never_waits_for_the_gpu():
    """No host synchronisation per message: with the GPU busy for ~0.3 s, posting several
    messages returns at once, none completes before the GPU gets to it, and all arrive
    intact (each in its own NCCL group; depth 4, so four are in flight together)."""
    import time
    _lib_or_skip()
    from mpi4py import MPI
    from megainfer.comm import Channel, MessageSpec
    t = nccl.NcclTransport(MPI.COMM_SELF)
    ch = Channel(t, [0], [0], MessageSpec.of(32, x=((64,), torch.float32)), depth=4)
    xs = [torch.randn(n, 64, device=t.device) for n in (32, 0, 5, 17)]  # [n, 64]

    def post_all(layer0):
        hs = []
        for i, x in enumerate(xs):
            with ch.group():
                rh = ch.recv(0, layer=layer0 + i, micro_batch=0)
                sh = ch.send(0, iteration=0, layer=layer0 + i, micro_batch=0, x=x)
            hs.append((rh, sh))
        return hs

    def check(hs):
        for x, (rh, sh) in zip(xs, hs):
            msg = rh.wait()
            assert msg.rows == x.shape[0] and torch.equal(msg["x"], x)
            msg.release()
            sh.wait()

    check(post_all(0))  # warm-up: NCCL connects, events and streams exist
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(600_000_000)  # ~0.3 s of GPU spin at ~2 GHz, ahead of the field copies
    hs = post_all(10)
    posted = time.perf_counter() - t0
    assert not any(rh.test() for rh, _ in hs)  # still queued behind the sleep
    check(hs)
    total = time.perf_counter() - t0
    assert total > 0.05, total  # the sleep really held the GPU
    assert posted < 0.25 * total, (posted, total)
    ch.close()
    t.close()
