"""Tensor parallelism in one process: ``world`` threads joined by a real sum all-reduce."""
import threading

import torch


def run_tp_threads(fn, world: int = 2, timeout: float = 300.0) -> list:
    """``fn(rank, all_reduce)`` on ``world`` threads -> each rank's return value. ``all_reduce(t)``
    returns the sum of every rank's ``t`` (each thread must call it the same number of times)."""
    barrier, box, outs, errors = threading.Barrier(world), [None] * world, [None] * world, []

    def all_reduce(rank):
        def f(t):
            box[rank] = t
            barrier.wait()
            s = sum(box[1:], box[0])
            barrier.wait()
            return s
        return f

    def run(rank):
        torch.set_num_threads(1)
        try:
            outs[rank] = fn(rank, all_reduce(rank))
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller
            errors.append(e)
            barrier.abort()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    [t.start() for t in threads]
    [t.join(timeout=timeout) for t in threads]
    if errors:
        raise errors[0]
    return outs
