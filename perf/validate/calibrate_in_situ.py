"""In-situ calibration: fit the model's layer times to traced runtime runs (megainfer.perfmodel.model.insitu).

    python perf/validate/calibrate_in_situ.py [--batches 32,64,128,256,384] [--profile conf/hardware/cpu_node.yaml]

``perf/validate/measure_runtime_runs.py --in-situ`` runs the same traced runs interleaved with the
validation runs, so both see the same moments of a shared machine.

For each batch size, one ``mpiexec -n 2 perf/jobs/pipeline_job.py`` run of the ``pipeline_bench`` shape
(1 attention + 1 expert rank, m = 1, traced) decodes 12 tokens after a 16-token prompt; every
decode iteration's attention and expert spans become fit samples. The fit replaces the
``pipeline_bench`` entry of the profile's ``fits`` (the node section and the other fits stay).
The default batches avoid 96, 192 and 288, the batch sizes of the validation runs
(perf/validate/measure_runtime_runs.py). Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from mpi_launch import run_job  # noqa: E402
from perf_paths import CONF  # noqa: E402
from pipeline_shape import PROMPT, job_args  # noqa: E402

from megainfer.bench.shapes import load_shape  # noqa: E402

from megainfer.calibration.calibrate import write_profile  # noqa: E402
from megainfer.perfmodel.model.insitu import fit_error, fit_in_situ, layer_samples  # noqa: E402

MODEL = "pipeline_bench"  # conf/plan_model/pipeline_bench.yaml: the shape bench_pipeline runs
DEFAULT_BATCHES = "32,64,128,256,384"
PROFILE = os.path.join(CONF, "hardware", "cpu_node.yaml")


def traced_run(batch: int, tmp: str) -> dict:
    """One traced m = 1 run of 1 attention + 1 expert rank at ``batch``: its merged trace."""
    root = os.path.join(tmp, f"b{batch}")
    run_job(2, "pipeline_job.py", os.path.join(tmp, f"b{batch}.json"),
            ["disaggregated:1:trace", *job_args(batch), "--trace-root", root])
    with open(os.path.join(root, "disaggregated_m1", "trace.json")) as f:
        return json.load(f)


def collect(batches, tmp: str, attn: list, expert: list) -> None:
    """One traced run per batch size; append its decode spans to ``attn`` and ``expert``."""
    for b in batches:
        at, ex = layer_samples(traced_run(b, tmp), PROMPT, load_shape(MODEL).top_k)
        attn += at
        expert += ex
        print(f"  in situ b={b}: {len(at)} attention, {len(ex)} expert spans", flush=True)


def fit_and_write(attn: list, expert: list, profile: str, what: str) -> dict:
    """Fit, replace the profile's pipeline_bench fit, note how it was measured; returns the fit."""
    experts = load_shape(MODEL).num_experts
    fit = fit_in_situ(attn, expert, experts)
    err = fit_error(fit, attn, expert, experts)
    with open(profile) as f:
        prof = yaml.safe_load(f)
    old = prof.setdefault("fits", {}).get(MODEL, {})
    prof["fits"][MODEL] = {**old, **fit, "dtype": "float32", "source": "in_situ"}
    note = (f"fits.{MODEL}: in situ on {datetime.date.today()} ({what}, load average "
            f"{os.getloadavg()[0]:.1f}); self-fit error attention max {100 * err['attention']['max']:.1f}% "
            f"median {100 * err['attention']['median']:.1f}%, expert max {100 * err['expert']['max']:.1f}% "
            f"median {100 * err['expert']['median']:.1f}%")
    notes = [n for n in prof.get("calibration_notes") or [] if not str(n).startswith(f"fits.{MODEL}")]
    prof["calibration_notes"] = notes + [note]
    write_profile(prof, profile)
    print(f"{MODEL} in situ: T_a = {fit['k2'] * 1e6:.1f} us + b * ({fit['k1'] * 1e6:.2f} us + "
          f"{fit['k1_ctx'] * 1e9:.1f} ns * ctx), T_e = {fit['k4'] * 1e6:.1f} us per expert + "
          f"{fit['k3'] * 1e6:.2f} us per (token, expert)")
    print(note)
    print(f"wrote {os.path.normpath(profile)}")
    return fit


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default=DEFAULT_BATCHES)
    ap.add_argument("--profile", default=PROFILE)
    a = ap.parse_args(argv)
    attn, expert = [], []
    collect([int(x) for x in a.batches.split(",")], tempfile.mkdtemp(prefix="insitu_"), attn, expert)
    fit_and_write(attn, expert, a.profile, f"perf/validate/calibrate_in_situ.py, batches {a.batches}")


if __name__ == "__main__":
    main()
