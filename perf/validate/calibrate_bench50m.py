"""In-situ layer fit of bench50m (the model perf/bench/bench_pd.py runs) on this machine, for the PD
validation (perf/validate/validate_sim_pd.py).

    python perf/validate/calibrate_bench50m.py [--out perf/results/bench50m_in_situ.json]

Each (batch, prompt, decode) of CONFIGS is one ``mpiexec -n 2 perf/jobs/pipeline_job.py`` launch of
the bench50m shape (1 attention + 1 expert rank holding all 8 experts, m = 1, dummy weights):
an untraced warm-up job, then the same job traced (the first call of each module is slow). Its
spans become samples (``megainfer.perfmodel.model.insitu``): every decode iteration's attention
(b tokens at context prompt + i) and expert span (b * top_k (token, expert) pairs), and the
prefill iteration's (iteration 0: all the batch's prompts in one chunk, mean context
(P + 1) / 2). The configurations cover what the PD runs compute: prefill chunks of 64 to 2048
tokens at contexts 8 to 512, decode batches of 1 to 16 at contexts 17 to 1030. The shared
machine's speed drifts by 2-3x within minutes, so before each configuration and after the last
one a probe run of one fixed configuration (PROBE, marked ``probe``) measures it: the fit
(``reference_fits``, used by perf/validate/validate_sim_pd.py) divides each run's spans by the speed of the
probes beside it, and ``perf/bench/bench_pd.py --calibrate`` probes between its launches the same way.

Writes the samples, the 1-min load average around each launch, the date and
``fits_unprobed`` (the fits of the raw spans, a first look; ``reference_fits`` makes the fits
perf/validate/validate_sim_pd.py uses, each run's spans divided by its probes' speed), each fit with its
self-error:

* ``decode``: attention T_a = k2 + b (k1 + k1_ctx ctx) over the decode spans (b sequences, one
  token each, ctx their mean context), experts over all spans;
* ``prefill``: the same attention form over the prefill spans (a chunk of b prompt tokens of a
  few sequences at mean context ctx), experts as in ``decode``.

A decode token costs the runtime's attention ~4x a prefill chunk's token on this CPU (probably
each sequence's paged KV read on its own), so one line cannot price both (the pooled fit's
self-error is ~100 %). Experts: T_e = k4 * active + k3 * pairs, ``active`` the expected number
of the rank's E experts that b tokens choosing top_k distinct experts uniformly reach,
E (1 - (1 - top_k / E)^b) (the simulator charges k4 per expert with tokens, as the runtime
skips empty experts); ``fit_in_situ``'s E k4 intercept assumes all E are busy, which a decode
batch of 2 does not make them.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from bench50m_probe import sample  # noqa: E402
from perf_paths import RESULTS  # noqa: E402
from megainfer.bench.results_io import write_json  # noqa: E402

import numpy as np  # noqa: E402

from megainfer.bench.shapes import BENCH50M  # noqa: E402
from megainfer.perfmodel.model.fit import fit_attention  # noqa: E402

EXPERTS, TOP_K = BENCH50M.num_experts, BENCH50M.top_k
CONFIGS = [(4, 16, 12), (16, 16, 12), (2, 256, 8), (8, 256, 6), (2, 512, 6), (1, 1024, 6)]
PROBE = (2, 256, 8)
OUT = os.path.join(RESULTS, "bench50m_in_situ.json")


def active(pairs) -> np.ndarray:
    """Expected experts (of EXPERTS) with tokens when pairs / TOP_K tokens pick TOP_K each."""
    return EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** (np.asarray(pairs, float) / TOP_K))


def _err(pred, t) -> dict:
    e = np.sort(np.abs(np.asarray(pred) / np.asarray(t) - 1))
    return {"max": float(e[-1]), "median": float(e[len(e) // 2])}


def fit_expert(expert: list) -> tuple[float, float]:
    """(k3, k4) of T_e = k4 * active(pairs) + k3 * pairs, least relative squares."""
    p, t = (np.array(v, float) for v in zip(*expert))
    a = np.stack([p, active(p)], 1) / t[:, None]
    (k3, k4), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return float(k3), float(k4)


def fits(samples: list, speed=None) -> dict:
    """The decode and prefill fits of ``samples`` (calibration runs; ``speed``: each run's time
    divisor per kind of span, {"decode": s, "prefill": s}, default 1)."""
    speed = speed or [{"decode": 1.0, "prefill": 1.0}] * len(samples)
    expert = [(x[0], x[1] / v[k]) for s, v in zip(samples, speed) for k in ("decode", "prefill")
              for x in s[f"{k}_expert"]]
    k3, k4 = fit_expert(expert)
    err_e = _err([k4 * active(p) + k3 * p for p, _ in expert], [t for _, t in expert])  # one expert fit
    out = {}
    for kind in ("decode", "prefill"):
        attn = [(x[0], x[1], x[2] / v[kind]) for s, v in zip(samples, speed) for x in s[f"{kind}_attention"]]
        k1, k1c, k2 = fit_attention(*zip(*attn), relative=True)
        err = {"attention": _err([k2 + b * (k1 + k1c * c) for b, c, _ in attn], [t for *_, t in attn]),
               "expert": err_e}
        out[kind] = {"k1": k1, "k1_ctx": k1c, "k2": k2, "k3": k3, "k4": k4, "dtype": "float32",
                     "source": "in_situ", "error": err}
    return out


def speed_of(cal: dict, fits: dict) -> dict:
    """Median measured / fitted over one calibration run's decode spans and over its prefill
    spans (attention and experts). The two differ on a loaded machine: a span of a few ms mostly
    runs within one time slice, a prefill span of 50-100 ms shares the cores with everything."""
    out = {}
    for kind in ("decode", "prefill"):
        f = fits[kind]
        r = [t / (f["k2"] + b * (f["k1"] + f["k1_ctx"] * c)) for b, c, t in cal[f"{kind}_attention"]]
        r += [t / (f["k4"] * active(p) + f["k3"] * p) for p, t in cal[f"{kind}_expert"]]
        out[kind] = float(np.median(r))
    return out


def reference_fits(cals: list, rounds: int = 5) -> tuple[dict, list]:
    """The fits at the reference speed (the fastest probe's, taken as the machine alone) and
    each run's speed factors: a probe run's are its own ``speed_of``, another run's the mean of
    the probes beside it (the configurations differ, so their own ratios would absorb the fit's
    errors)."""
    probe = [i for i, c in enumerate(cals) if c.get("probe")]
    speeds = [{"decode": 1.0, "prefill": 1.0} for _ in cals]
    for _ in range(rounds):
        f = fits(cals, speeds)
        ps = {i: speed_of(cals[i], f) for i in probe}
        ref = {k: min(p[k] for p in ps.values()) for k in ("decode", "prefill")}
        for i in range(len(cals)):
            near = [ps[j] for j in (i - 1, i + 1) if j in ps] if i not in ps else [ps[i]]
            speeds[i] = {k: statistics.mean(p[k] for p in near) / ref[k] for k in ref}
    return fits(cals, speeds), speeds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="cal_bench50m_")
    samples = []
    for k, (b, p, d) in enumerate([c for x in CONFIGS for c in (PROBE, x)] + [PROBE]):
        samples.append(dict(sample(b, p, d, tmp), probe=k % 2 == 0))
        print(f"  {'probe ' if k % 2 == 0 else ''}b={b} P={p}: {len(samples[-1]['decode_attention'])} + "
              f"{len(samples[-1]['prefill_attention'])} attention spans, load {samples[-1]['load_average'][0]:.2f}",
              flush=True)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": "bench50m", "configs": CONFIGS, "probe": PROBE, "samples": samples,
           "fits_unprobed": fits(samples)}
    loads = [x for s in samples for x in s["load_average"]]
    res["load_average"] = {"mean": sum(loads) / len(loads), "min": min(loads), "max": max(loads)}
    for name, f in res["fits_unprobed"].items():
        e = f["error"]
        print(f"{name}: T_a = {f['k2'] * 1e6:.0f} us + b ({f['k1'] * 1e6:.2f} us + {f['k1_ctx'] * 1e9:.1f} ns ctx), "
              f"T_e = {f['k4'] * 1e6:.0f} us/expert + {f['k3'] * 1e6:.2f} us/pair; self-fit error attention "
              f"max {e['attention']['max']:.0%} median {e['attention']['median']:.0%}, expert max "
              f"{e['expert']['max']:.0%} median {e['expert']['median']:.0%}")
    write_json(a.out, res)


if __name__ == "__main__":
    main()
