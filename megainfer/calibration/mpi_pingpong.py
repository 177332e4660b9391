"""MPI ping-pong between ranks 0 and 1 over message sizes; rank 0 writes JSON.

Run: mpiexec -n 2 python -m megainfer.calibration.mpi_pingpong OUT.json [max_bytes] [repeats]
One-way time per size = median round trip / 2 (numpy buffers, like the comm layer's CPU
transport; the tags are ``runtime/tags.py``'s ``PING`` and ``PONG``).
"""
from __future__ import annotations

import json
import statistics
import sys

import numpy as np
from mpi4py import MPI

from megainfer.runtime import tags


def main() -> None:
    out = sys.argv[1]
    max_bytes = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 24
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    sizes, s = [], 8
    while s <= max_bytes:
        sizes.append(s)
        s *= 4
    res = []
    for size in sizes:
        buf = np.zeros(size, np.uint8)
        reps = repeats if size < (1 << 20) else max(5, repeats // 4)
        times = []
        for it in range(reps + 2):
            comm.Barrier()
            t0 = MPI.Wtime()
            if rank == 0:
                comm.Send(buf, 1, tag=tags.PING)
                comm.Recv(buf, 1, tag=tags.PONG)
            elif rank == 1:
                comm.Recv(buf, 0, tag=tags.PING)
                comm.Send(buf, 0, tag=tags.PONG)
            if it >= 2:
                times.append((MPI.Wtime() - t0) / 2)
        res.append({"bytes": size, "one_way_s": statistics.median(times)})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": comm.Get_size(), "results": res}, f)


if __name__ == "__main__":
    main()
