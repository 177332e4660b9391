"""WeightChannel under mpiexec: world rank 0 stays out (an attention rank); ranks 1..K-1 are the
expert communicator and move seeded weight buffers among themselves in small messages.

    mpiexec -n K python weight_channel_job.py OUT_DIR DEVICE [hang]
DEVICE: cpu (the MPI transport, the stand-in) or cuda (cuda_ipc, every rank on the one GPU).
Every expert rank sends every other a different number of moves of uneven sizes (smaller than
a row, exact multiples of a message, several messages), each from two parts (a slot's gate_up
and down). Writes OUT_DIR/rank<r>.json: whether every received buffer is exact, the messages
sent and received over the channel, and what the schedule predicts for both.
``hang``: the last rank builds the channel, then never sends; the others must fail naming it.
"""
import json
import os
import sys

import torch

torch.set_num_threads(1)

from abort_on_error import run_or_abort  # noqa: E402
from mpi4py import MPI  # noqa: E402

from megainfer.comm.wait import WaitPolicy  # noqa: E402
from megainfer.runtime.control import ControlPlane, RankFailure  # noqa: E402
from megainfer.runtime.weight_channel import (Inbound, Outbound, close_weight_channel,  # noqa: E402
                                              eplb_moves_kind, n_chunks, open_weight_channel,
                                              world_ranks_of)

ROW, CHUNK = 8, 8 * 8 * 4  # 8 rows of 8 fp32 per message: 64 elements


def moves_between(src: int, dst: int) -> list[tuple[int, int, int, int]]:
    """(layer, slot, numel, split) of the moves src -> dst (expert indices), the same on both."""
    out = []
    for i in range((src + 2 * dst) % 3 + 1):
        layer, slot = i % 2, 3 * i + dst
        numel = [5, 64, 200, 128][(src + dst + i) % 4]
        out.append((layer, slot, numel, numel // 3))
    return out


def data(src: int, layer: int, slot: int, numel: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * src + 10 * layer + slot)
    return torch.randn(numel, generator=g).to(device)


def main():
    out_dir, device = sys.argv[1], torch.device(sys.argv[2])
    hang = len(sys.argv) > 3 and sys.argv[3] == "hang"
    world = MPI.COMM_WORLD
    wr = world.Get_rank()
    experts = world.Split(0 if wr == 0 else 1, wr)
    if wr == 0:
        world.Barrier()
        return
    if device.type == "cuda":
        torch.cuda.set_device(0)
    me, E = experts.Get_rank(), experts.Get_size()
    control = ControlPlane(experts, f"[expert {me}]", WaitPolicy(timeout_s=3.0 if hang else 60.0))
    kind = eplb_moves_kind("device", device, "auto")
    ranks = list(range(E))
    wc, bounded = open_weight_channel(kind, experts, device, torch.float32, ranks, ranks, control,
                                      world_ranks_of(experts), "EPLB weight move",
                                      chunk_bytes=CHUNK, row=ROW)
    outs, ins = [], []
    for p in ranks:
        if p == me:
            continue
        for layer, slot, numel, split in moves_between(me, p):
            w = data(me, layer, slot, numel, device)
            outs.append(Outbound(p, layer, slot, (w[:split].view(1, -1), w[split:])))
        for layer, slot, numel, _ in moves_between(p, me):
            ins.append(Inbound(p, layer, slot, torch.full((numel,), float("nan"), device=device)))
    if hang and me == E - 1:
        world.Barrier()  # never sends: the others time out first
        return
    try:
        wc.exchange(outs, ins)
    except RankFailure as e:
        with open(os.path.join(out_dir, f"rank{wr}.err"), "w") as f:
            f.write(str(e))
        world.Barrier()
        return
    ok = all(torch.equal(mv.out.cpu(), data(mv.peer, mv.layer, mv.slot, mv.out.numel(), "cpu"))
             for mv in ins)
    want_sent = sum(n_chunks(mv.parts[0].numel() + mv.parts[1].numel(), wc.per_message)
                    for mv in outs)
    want_recv = sum(n_chunks(mv.out.numel(), wc.per_message) for mv in ins)
    close_weight_channel(wc, bounded)
    with open(os.path.join(out_dir, f"rank{wr}.json"), "w") as f:
        json.dump({"ok": ok, "moves_in": len(ins), "sent": wc.sent, "received": wc.received,
                   "want_sent": want_sent, "want_received": want_recv,
                   "per_message": wc.per_message}, f)
    world.Barrier()


if __name__ == "__main__":
    run_or_abort(main)
