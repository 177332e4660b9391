"""MPI worker: M2N round trips with tensors on a device, through one transport, verified exactly.

Usage: mpiexec -n K python device_roundtrip.py TRANSPORT DEVICE OUT.json
TRANSPORT: mpi | cuda_ipc | nccl | staging (``StagingTransport`` forced, also on cpu: how the
CPU tests exercise the device staging path). Two layouts in one launch, on the whole world:
disaggregated (rank 0 attention, the others experts) and colocated (every rank both: a rank
is its own peer). Row counts run over 0..CAP (more distinct sizes than a slot keeps persistent
sends), payloads are a function of (iteration, layer, micro-batch, src, dst) rebuilt by the
receiver; experts answer 2*hidden + sum(weights). A message of CAP+1 rows must be refused.
Rank 0 writes {"ok": messages checked, "too_large": refused?, "transport": class name}.
"""
import json
import sys
import zlib

import torch
from mpi4py import MPI

from abort_on_error import run_or_abort

from megainfer.comm import M2N, MessageTooLargeError, WaitPolicy, combine_spec, dispatch_spec
from megainfer.comm import make_transports

WORLD = MPI.COMM_WORLD
H, K, CAP, ITERS, LAYERS, MBS = 16, 2, 80, 12, 2, 2


def rows_for(key) -> int:
    return zlib.crc32(repr(key).encode()) % (CAP + 1)


def payload(key, device, dtype):
    n = rows_for(key)
    base = float(zlib.crc32(repr(key).encode()) % 97)
    h = (torch.arange(n * H, dtype=torch.float32).view(n, H) % 31 + base).to(device, dtype)
    ids = (torch.arange(n * K, dtype=torch.int32).view(n, K) + int(base)).to(device)
    w = (torch.arange(n * K, dtype=torch.float32).view(n, K) / 8 + 1).to(device)
    return h, ids, w


def transports(kind: str, device):
    if kind == "staging":
        from megainfer.comm.staging import StagingTransport
        t = StagingTransport(WORLD, device)
        return t, t
    return make_transports(kind, WORLD, device=device)


def run_layout(link: M2N, attn, experts, device, dtype) -> int:
    me, checked = WORLD.Get_rank(), 0
    for it in range(ITERS):
        for layer in range(LAYERS):
            replies = {}
            for mb in range(MBS):
                if me in attn:
                    replies[mb] = [link.recv_combine(e, layer=layer, micro_batch=mb, iteration=it)
                                   for e in experts]
                    with link.a2e.group():
                        for e in experts:
                            h, ids, w = payload((it, layer, mb, me, e), device, dtype)
                            link.dispatch(e, iteration=it, layer=layer, micro_batch=mb,
                                          hidden=h, topk_ids=ids, topk_weights=w)
                if me in experts:
                    msgs = [link.recv_dispatch(a, layer=layer, micro_batch=mb,
                                               iteration=it).wait() for a in attn]
                    with link.e2a.group():
                        for a, m in zip(attn, msgs):
                            h, ids, w = payload((it, layer, mb, a, me), device, dtype)
                            assert m.rows == h.shape[0], (m.rows, h.shape)
                            assert torch.equal(m["hidden"], h) and torch.equal(m["topk_ids"], ids) \
                                and torch.equal(m["topk_weights"], w), ("dispatch", it, layer, mb)
                            out = m["hidden"] * 2 + m["topk_weights"].sum(1, keepdim=True).to(dtype)
                            link.combine(a, iteration=it, layer=layer, micro_batch=mb, out=out)
                            checked += 1
                    for m in msgs:
                        m.release()
            for mb, handles in replies.items():
                for e, hnd in zip(experts, handles):
                    m = hnd.wait()
                    h, _, w = payload((it, layer, mb, me, e), device, dtype)
                    want = h * 2 + w.sum(1, keepdim=True).to(dtype)
                    assert torch.equal(m["out"], want), ("combine", it, layer, mb, e)
                    m.release()
                    checked += 1
    return checked


def main():
    kind, device, out = sys.argv[1], torch.device(sys.argv[2]), sys.argv[3]
    if device.type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size, checked, too_large = WORLD.Get_size(), 0, None
    for attn, experts in (([0], list(range(1, size))), (list(range(size)), list(range(size)))):
        t = transports(kind, device)
        link = M2N(t, attn, experts, dispatch_spec(CAP, H, K, dtype), combine_spec(CAP, H, dtype),
                   micro_batches=MBS, wait=WaitPolicy(timeout_s=60))
        checked += run_layout(link, attn, experts, device, dtype)
        if WORLD.Get_rank() == 0 and too_large is None:
            h = torch.zeros(CAP + 1, H, dtype=dtype, device=device)
            try:
                link.dispatch(experts[0], iteration=99, layer=0, micro_batch=0, hidden=h,
                              topk_ids=torch.zeros(CAP + 1, K, dtype=torch.int32, device=device),
                              topk_weights=torch.zeros(CAP + 1, K, device=device))
                too_large = False
            except MessageTooLargeError:
                too_large = True
        WORLD.Barrier()
        link.close()
        for tr in {id(x): x for x in t}.values():
            tr.close()
    total = WORLD.reduce(checked, root=0)
    if WORLD.Get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"ok": total, "too_large": too_large, "transport": type(t[0]).__name__}, f)


if __name__ == "__main__":
    run_or_abort(main)
