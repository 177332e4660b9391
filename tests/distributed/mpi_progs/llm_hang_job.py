"""A rank that stops answering mid-generate: under mpiexec -n 3 (a1e2), rank 0 freezes expert
rank ``VICTIM`` (SIGSTOP) while ``LLM.generate`` runs; the generate must raise
``RankLostError`` naming that rank and its role within ``comm.timeout_s`` (+ slack). Rank 0
writes what it caught to OUT.json, kills the frozen rank and exits 3 (the job ends there).

    mpiexec -n 3 python llm_hang_job.py OUT.json CKPT VICTIM TIMEOUT_S
"""
import json
import os
import signal
import sys
import threading
import time

import torch

torch.set_num_threads(1)


def main():
    from mpi4py import MPI
    pids = MPI.COMM_WORLD.allgather(os.getpid())
    out, ckpt, victim, timeout_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    from megainfer import LLM, SamplingParams
    from megainfer.engine.failures import RankLostError
    llm = LLM(ckpt, deploy="a1e2", max_model_len=256, max_num_seqs=4, block_size=4,
              num_blocks=256, overrides=[f"comm.timeout_s={timeout_s}"])
    threading.Timer(0.5, os.kill, (pids[victim], signal.SIGSTOP)).start()
    t0 = time.perf_counter()
    got = {"raised": None}
    try:
        llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=200, ignore_eos=True),
                     use_tqdm=False)
    except RankLostError as e:
        got = {"raised": type(e).__name__, "rank": e.rank, "role": e.role, "message": str(e)}
    got["seconds"] = time.perf_counter() - t0
    with open(out, "w") as f:
        json.dump(got, f)
    os.kill(pids[victim], signal.SIGKILL)
    sys.stdout.flush()
    os._exit(3)


if __name__ == "__main__":
    main()
