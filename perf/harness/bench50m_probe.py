"""One traced bench50m calibration run (``mpiexec -n 2 perf/jobs/pipeline_job.py``: 1 attention +
1 expert rank, m = 1, dummy weights): its spans as in-situ samples. ``perf/validate/
calibrate_bench50m.py`` fits them; ``perf/bench/bench_pd.py --calibrate`` probes the machine's
speed between launches with the same run."""
from __future__ import annotations

import json
import os

from mpi_launch import run_job

from megainfer.bench.shapes import BENCH50M as _B
from megainfer.bench.sim_validation import hop_gaps, prefill_samples
from megainfer.perfmodel.model.insitu import layer_samples

SHAPE = ["--hidden", _B.hidden_size, "--inter", _B.moe_intermediate_size, "--layers", _B.num_layers,
         "--heads", _B.num_heads, "--kv-heads", _B.num_kv_heads, "--experts", _B.num_experts,
         "--top-k", _B.top_k, "--vocab", _B.vocab_size]
TOP_K = _B.top_k


def traced(batch: int, prompt: int, decode: int, tmp: str) -> dict:
    """One warm-up job then one traced job of this batch: the traced job's merged trace."""
    root = os.path.join(tmp, f"b{batch}p{prompt}")
    run_job(2, "pipeline_job.py", os.path.join(tmp, "o.json"),
            ["disaggregated:1,disaggregated:1:trace", *SHAPE, "--batch", batch, "--prompt", prompt,
             "--decode", decode, "--trace-root", root])
    with open(os.path.join(root, "disaggregated_m1", "trace.json")) as f:
        return json.load(f)


def sample(b: int, p: int, d: int, tmp: str) -> dict:
    """One calibration run's spans, its hops and gaps between iterations (``hop_gaps``) and the
    load average before and after it."""
    l0 = os.getloadavg()[0]
    tr = traced(b, p, d, tmp)
    da, de = layer_samples(tr, p, TOP_K)
    pa, pe = prefill_samples(tr, p, TOP_K)
    hops, steps = hop_gaps(tr)
    return {"batch": b, "prompt": p, "decode": d, "load_average": [l0, os.getloadavg()[0]],
            "decode_attention": da, "decode_expert": de, "prefill_attention": pa, "prefill_expert": pe,
            "hops": hops, "step_gaps": steps}
