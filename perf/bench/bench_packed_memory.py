"""What the oneDNN-reordered weights (``kernels/cpu_gemm.py``) cost in memory beside the dense
parameters they are made from, on bench_decode_step's model.

    python perf/bench/bench_packed_memory.py [--batch 32 --context 100]
        (JSON: perf/results/bench_packed_memory.json)

Builds the 54.5M Mixtral-shaped checkpoint, loads it, and reads the process's resident memory
(``/proc/self/statm``) before and after the first decode steps (the packs are made on first
use); the packs' own bytes are summed from the caches ``cpu_gemm`` keeps on each weight
(``torch.ops.mkldnn._nbytes``), per weight kind, beside the parameters' bytes. Each pack's
``to_dense()`` is checked to give back its weight exactly (what a reader of a dropped dense
copy would have to call).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "harness"))
import bench_offline  # noqa: E402
from bench_decode_step import SHAPE  # noqa: E402
from decode_steps import OursStep  # noqa: E402
from perf_paths import RESULTS  # noqa: E402

from megainfer.bench.results_io import write_json  # noqa: E402


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def packs_of(model) -> dict:
    """{kind: [param bytes, pack bytes, packs exact]} over every weight with reordered copies."""
    from megainfer.kernels import cpu_gemm
    out = {}
    for name, p in model.named_parameters():
        kind = ("experts" if ".experts." in name
                else "q, k, v (one stacked pack)" if name.endswith(("q_proj.weight", "k_proj.weight",
                                                                     "v_proj.weight"))
                else "lm_head" if "lm_head" in name else "embedding" if "embed" in name
                else "o_proj, norms, router")
        row = out.setdefault(kind, [0, 0, True])
        row[0] += p.numel() * p.element_size()
        cache = getattr(p, cpu_gemm._ATTR, None)
        packs = list(cache[1].items()) if cache else []
        for i, pk in packs:
            row[1] += torch.ops.mkldnn._nbytes(pk)
            row[2] &= torch.equal(pk.to_dense(), (p if i is None else p[i]).detach())
        cat = getattr(p, cpu_gemm._ATTR_CAT, None)
        if cat is not None:
            row[1] += torch.ops.mkldnn._nbytes(cat[1])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_packed_memory.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from megainfer.config import LoadConfig, ModelConfig
    from megainfer.models.loader import build_model
    with tempfile.TemporaryDirectory() as d:
        bench_offline.build_checkpoint(d, SimpleNamespace(**SHAPE))
        model = build_model(ModelConfig.from_pretrained(d), LoadConfig(path=d))
    step = OursStep(model, a.batch, a.context)  # its KV caches allocated and written here
    before = rss()
    for _ in range(3):
        step()
    after = rss()
    kinds = packs_of(model)
    params = sum(v[0] for v in kinds.values())
    packed = sum(v[1] for v in kinds.values())
    print(f"{'kind':<28}{'params MB':>10}{'packs MB':>10}{'exact':>7}")
    for k, (pb, kb, ok) in kinds.items():
        print(f"{k:<28}{pb / 1e6:10.1f}{kb / 1e6:10.1f}{'yes' if ok else 'no':>7}")
    print(f"{'all':<28}{params / 1e6:10.1f}{packed / 1e6:10.1f}\nresident memory over the "
          f"first 3 steps (B={a.batch}, context {a.context}): +{(after - before) / 1e6:.1f} MB")
    write_json(a.out, dict(
        name="bench_packed_memory", args=vars(a), shape=SHAPE,
        kinds={k: dict(param_bytes=v[0], pack_bytes=v[1], packs_exact=v[2]) for k, v in kinds.items()},
        param_bytes=params, pack_bytes=packed, rss_growth_first_steps=after - before,
        baseline="the dense parameters' bytes in the same process",
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        torch=torch.__version__, load_average=os.getloadavg()), indent=2)


if __name__ == "__main__":
    main()
