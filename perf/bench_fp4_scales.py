"""fp4_e2m1 block-scale rules on synthetic rows: round-trip error per candidate set, and what the
least-squared-error choice costs the torch quantiser (docs/kv_cache.md, "Scales").

    python perf/bench_fp4_scales.py [--rows 4096 --dim 128 --repeats 7]

Error: relative RMS round-trip error (||dequant(quant(x)) - x|| / ||x||) of rows of ``--dim``
values, for each rule, with both second-level scales: ``token_head`` (each row's E8M0 2**e,
``kv_rows.e8m0_exponent``) and ``tensor`` (one scale for all the rows, 2 x amax / 2688, as the
first write sets it). Rules: ``amax/6`` (the previous stored rule), least squared error over a
candidate set of divisors d (block scale amax / d rounded to E4M3 as stored), and two
variants of the row exponent for ``token_head``: 2**e >= amax / 1792 (stored: room for d = 4
on the row's largest block, whose scale amax / 4 would saturate E4M3 under the previous
2**e >= amax / 2688). Rows: N(0, 1); N(0, 1) with one outlier of 20 sigma per row; Student t
with 3 degrees of freedom (heavy tails); N(0, 1) times a per-channel scale from a log-uniform
over [0.1, 10] (channel outliers, as keys have).
Cost: CPU process time of ``quant_fp4`` on [rows, dim] (one torch thread), the previous rule
against the stored one; medians of ``--repeats`` alternating runs, in the same run.
Writes ``perf/results/bench_fp4_scales.json``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from results_io import write_json  # noqa: E402

from megainfer.kernels import kv_fp4, kv_quant  # noqa: E402
from megainfer.kernels.kv_rows import _pow2, e8m0_exponent  # noqa: E402

SETS = {"{6, 5.5, 5, 4.5, 4} (stored)": (6.0, 5.5, 5.0, 4.5, 4.0),
        "{6, 5, 4}": (6.0, 5.0, 4.0),
        "{6, 5.5, 5}": (6.0, 5.5, 5.0),
        "{6, 5.75, ..., 4} (9)": tuple(6.0 - 0.25 * i for i in range(9)),
        "{6, 5.5, ..., 3} (7)": tuple(6.0 - 0.5 * i for i in range(7))}


def rows(kind: str, n: int, D: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, D, generator=g)
    if kind == "gaussian + outlier":
        x[torch.arange(n), torch.randint(0, D, (n,), generator=g)] = 20.0
    elif kind == "student-t(3)":
        x = x / (torch.randn(n, D, 3, generator=g).pow(2).mean(-1)).sqrt()
    elif kind == "channel scales":
        x = x * torch.exp(torch.empty(D).uniform_(-2.3026, 2.3026, generator=g))
    return x


def rel_rms(x: torch.Tensor, g: torch.Tensor, rule: str, divisors=None) -> float:
    *lead, D = x.shape
    xb = x.reshape(*lead, D // 16, 16)
    bs8, code = kv_fp4.block_scales(xb, g, rule, divisors or kv_fp4.FP4_DIVISORS)
    y = kv_fp4._const("lut", x.device)[code.long()] * (bs8.float() * g)[..., None]
    return ((y - xb).norm() / xb.norm()).item()


def errors(x: torch.Tensor) -> dict:
    amax = x.abs().amax(-1, keepdim=True)
    g_row = {"e from amax/1792 (stored)": _pow2(e8m0_exponent(amax)),
             "e from amax/2688 (previous)": _pow2(e8m0_exponent(amax / 1.5))}
    g_tensor = x.abs().amax() * kv_quant.SCALE_HEADROOM / kv_quant.format_max("fp4_e2m1")
    out = {}
    for gname, g in [("tensor", g_tensor)] + [(f"token_head, {k}", v) for k, v in g_row.items()]:
        res = {"amax/6": rel_rms(x, g, "amax/6")}
        for name, divs in SETS.items():
            res[name] = rel_rms(x, g, "lsq", divs)
        out[gname] = res
    return out


def cost(n: int, D: int, repeats: int) -> dict:
    x = torch.randn(n, D)
    g = x.abs().amax() * kv_quant.SCALE_HEADROOM / kv_quant.format_max("fp4_e2m1")
    t = {"amax/6": [], "lsq": []}
    for _ in range(repeats):
        for rule in t:
            c0 = time.process_time()
            kv_fp4.quant_fp4(x, g, rule)
            t[rule].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in t.items()}
    return {"rows": n, "dim": D, "process_s": t, "median_s": med,
            "ratio": med["lsq"] / med["amax/6"],
            "us_per_row_amax6": 1e6 * med["amax/6"] / n, "us_per_row_lsq": 1e6 * med["lsq"] / n}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_fp4_scales.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    res = {}
    for kind in ("gaussian", "gaussian + outlier", "student-t(3)", "channel scales"):
        res[kind] = errors(rows(kind, a.rows, a.dim, gen))
    names = ["amax/6"] + list(SETS)
    print(f"relative RMS round-trip error, rows of {a.dim} (lower is better)")
    print(f"{'rows':<20}{'second-level scale':<36}" + "".join(f"{n[:22]:>24}" for n in names))
    for kind, r in res.items():
        for gname, e in r.items():
            print(f"{kind:<20}{gname:<36}" + "".join(f"{e[n]:>24.4f}" for n in names))
    c = cost(a.rows, a.dim, a.repeats)
    print(f"\nquant_fp4 on [{a.rows}, {a.dim}], one thread, CPU process time, medians of "
          f"{a.repeats}: amax/6 {c['median_s']['amax/6']:.4f}s"
          f" ({c['us_per_row_amax6']:.2f} us/row), lsq {c['median_s']['lsq']:.4f}s "
          f"({c['us_per_row_lsq']:.2f} us/row): {c['ratio']:.2f}x")
    write_json(a.out, {"bench": "fp4_scales", "date": datetime.datetime.utcnow().isoformat() + "Z",
                       "host": platform.node(), "torch": torch.__version__, "args": vars(a),
                       "candidate_sets": SETS, "rel_rms_error": res, "cost": c})


if __name__ == "__main__":
    main()
