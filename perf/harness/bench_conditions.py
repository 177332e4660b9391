"""The shared machine's conditions while a bench runs: the 1-min load average sampled during
its launches (``LoadSampler``) and a traced bench50m probe between launches (``calibration``),
which ``perf/validate/validate_sim_pd.py`` and ``perf/validate/predict_pd_offload.py`` read the
machine's speed off (``megainfer.bench.pd_runs.conditions``). Used by ``perf/bench/bench_pd.py``
and ``perf/bench/bench_pd_offload.py``."""
from __future__ import annotations

import os
import tempfile
import threading

from bench50m_probe import sample


class LoadSampler:
    """The 1-min load average every ``every_s`` seconds while the ``with`` block runs."""

    def __init__(self, every_s: float = 5.0):
        self.every_s, self.samples, self._stop = every_s, [], threading.Event()

    def __enter__(self):
        self.samples.append(os.getloadavg()[0])
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.samples.append(os.getloadavg()[0])


def calibration(spec: str) -> dict:
    """One traced bench50m run (perf/validate/calibrate_bench50m.py) of ``spec`` = "B,P,D"
    (batch, prompt, new tokens) between launches: its spans tell how fast the shared machine was
    then."""
    b, p, d = (int(x) for x in spec.split(","))
    with tempfile.TemporaryDirectory(prefix="bench_cal_") as tmp:  # its traces are read back
        return dict(sample(b, p, d, tmp), probe=True)
