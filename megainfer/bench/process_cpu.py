"""CPU time of processes from Linux ``/proc`` (the benchmarks' and tests' rank CPU figures)."""
from __future__ import annotations

import os
import time


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, every thread."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(pids, seconds: float = 1.0) -> list[float]:
    """Each process's CPU over ``seconds`` of wall time, as a fraction of a core."""
    c0, t0 = [cpu_seconds(p) for p in pids], time.perf_counter()
    time.sleep(seconds)
    dt = time.perf_counter() - t0
    return [(cpu_seconds(p) - c) / dt for p, c in zip(pids, c0)]
