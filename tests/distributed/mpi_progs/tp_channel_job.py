"""TPChannel under mpiexec: every rank of COMM_WORLD is one TP rank (world rank = TP rank).

    mpiexec -n K python tp_channel_job.py OUT_DIR [hang]
Each rank writes OUT_DIR/rank<r>.pt (safetensors) with the results of: fp32 and bf16
all-reduces of seeded partials, a broadcast from the leader, an all-reduce and a broadcast
larger than the channel's capacity (sent in pieces), an all-reduce of another shape (the host
path through TPGroup), and the count of collectives that went point to point.
``hang``: the last rank never joins the second all-reduce; the others must fail naming it.
"""
import os
import sys

import torch

torch.set_num_threads(1)

from abort_on_error import run_or_abort  # noqa: E402
from mpi4py import MPI  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from megainfer.comm.mpi import MpiTransport  # noqa: E402
from megainfer.comm.wait import WaitPolicy  # noqa: E402
from megainfer.runtime.control import ControlPlane, RankFailure  # noqa: E402
from megainfer.runtime.tp_channel import TPChannel  # noqa: E402
from megainfer.runtime.tp_group import TPGroup  # noqa: E402

H, CAP = 24, 5


def part(rank: int, rows: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(rows, H, generator=g) * 10).to(dtype)


def main():
    out_dir, hang = sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "hang"
    comm = MPI.COMM_WORLD
    r, n = comm.Get_rank(), comm.Get_size()
    policy = WaitPolicy(timeout_s=3.0 if hang else 60.0)
    control = ControlPlane(comm, f"[attn dp0 tp{r}]", policy)
    t32 = TPChannel(MpiTransport(comm), H, torch.float32, CAP, policy, list(range(n)), control.me)
    t16 = TPChannel(MpiTransport(comm), H, torch.bfloat16, CAP, policy, list(range(n)), control.me)
    group = TPGroup(comm, control, None, t32)
    res = {"ar32": group.all_reduce(part(r, 4, torch.float32))}
    if hang:
        if r == n - 1:
            comm.Barrier()  # never sends its part: the others time out first
            return
        try:
            t32.all_reduce(part(r, 3, torch.float32))
        except RankFailure as e:
            with open(os.path.join(out_dir, f"rank{r}.err"), "w") as f:
                f.write(str(e))
        comm.Barrier()
        return
    res["ar16"] = t16.all_reduce(part(r, CAP, torch.bfloat16))
    res["bcast"] = group.broadcast_from_leader(part(r, 2, torch.float32), "test rows")
    res["empty"] = group.all_reduce(part(r, 0, torch.float32))
    res["big"] = group.all_reduce(part(r, CAP + 3, torch.float32))  # over capacity: 2 pieces
    res["bigcast"] = group.broadcast_from_leader(part(r, 2 * CAP + 1, torch.float32), "rows")
    res["amax"] = group.all_reduce(torch.full((2,), float(r + 1)))  # another shape: host path
    res["sent"] = torch.tensor([t32.sent, t16.sent])
    save_file({k: v.contiguous() for k, v in res.items()}, os.path.join(out_dir, f"rank{r}.pt"))
    t32.close()
    t16.close()


if __name__ == "__main__":
    run_or_abort(main)
