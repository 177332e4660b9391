"""The request route's throughput guard: this tree against another checkout (the commit
before the one-route redesign), interleaved in one run.

    python perf/bench/bench_route_ab.py --before /path/to/old/worktree [--rounds 3]
        (JSON: perf/results/bench_route_ab.json)

Both sides run from this machine's venv with ``PYTHONPATH`` set to their own tree (the old
tree gets the ``megainfer/{launch,kernels,conf}`` links an editable install would give it).
Workloads, on one checkpoint (a small Mixtral-shaped model, random weights, 1 torch thread per
process): ``megainfer-launch``'s offline job in single mode, a1e2 (3 ranks) and p1a1e2 (4
ranks), its ``output_tokens_per_s`` read from the job's summary.json (the job's own clock:
start-up excluded); and ``AsyncLLM`` in single mode, concurrent streams, output tokens per
second of the generate calls. Rounds alternate which side goes first; the table gives medians
and after/before.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "harness"))
from perf_paths import PERF, RESULTS  # noqa: E402

from megainfer.bench.results_io import write_json  # noqa: E402
from megainfer.core_client.mpiexec_job import find_mpiexec  # noqa: E402
from megainfer.tools.make_tiny import make_tiny  # noqa: E402

ROOT = os.path.dirname(PERF)
LINKS = {"launch": "launch", "kernels": "kernels", "conf": "conf"}  # megainfer.X -> tree/X
SHAPE = dict(vocab=2048, hidden=256, layers=4, heads=8, kv_heads=4, experts=8, top_k=2,
             inter=512, max_pos=1024)
SIZES = ["scheduler.max_model_len=256", "scheduler.max_num_seqs=32",
         "scheduler.max_num_batched_tokens=256", "cache.num_blocks=1200", "cache.block_size=16"]
WORKLOADS = {"offline single": ("single", 1), "offline a1e2": ("a1e2", 3),
             "offline p1a1e2": ("p1a1e2", 4), "AsyncLLM single": None}
ASYNC = """
import asyncio, json, sys, time
from megainfer import AsyncLLM, SamplingParams
ckpt, n, out_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = AsyncLLM(ckpt, max_model_len=256, max_num_seqs=32, max_num_batched_tokens=256,
               num_blocks=1200, block_size=16, cpu_threads=1)
p = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
async def one(i):
    async for o in eng.generate({"prompt_token_ids": [3 + (i * 7 + j) % 2000 for j in range(32)]},
                                p, request_id=f"r{i}"):
        last = o
    return len(last.outputs[0].token_ids)
async def main():
    await asyncio.gather(*(one(i) for i in range(4)))  # warm-up
    t0 = time.perf_counter()
    toks = sum(await asyncio.gather(*(one(100 + i) for i in range(n))))
    return toks / (time.perf_counter() - t0)
print(json.dumps({"output_tokens_per_s": asyncio.run(main())}), flush=True)
eng.shutdown()
"""


def side_of(root: str) -> dict:
    """Another checkout gets the links its own editable install would give (removed at the
    end: ``unlink``); this one has them from the install."""
    root = os.path.abspath(root)
    made = []
    for name, target in LINKS.items() if root != ROOT else ():
        link = os.path.join(root, "megainfer", name)
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", target), link)
            made.append(link)
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no",
                                 "--", "megainfer",
                                 "launch"], capture_output=True, text=True).stdout.strip())
    return {"root": root, "commit": commit + ("+changes" if dirty else ""), "links": made}


def unlink(sides: dict) -> None:
    for side in sides.values():
        for link in side.pop("links"):
            os.unlink(link)


def env_of(side: dict) -> dict:
    return dict(os.environ, PYTHONPATH=side["root"], OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")


def run_offline(side, deploy, ranks, ckpt, prompts, tmp, tag) -> float:
    out = os.path.join(tmp, tag)
    cmd = [sys.executable, "-m", "megainfer.launch.main", f"model.path={ckpt}",
           f"deploy={deploy}", f"io.input={prompts}", f"io.output={out}/gen.jsonl",
           "io.resume=false", "io.progress=false", "sampling.temperature=0",
           "sampling.ignore_eos=true", f"sampling.max_tokens={ARGS.output_len}", "deploy.cpu_threads=1",
           *SIZES, f"hydra.run.dir={out}"]
    if ranks > 1:
        cmd = [find_mpiexec(), "-n", str(ranks), *cmd]
    p = subprocess.run(cmd, cwd=tmp, env=env_of(side), capture_output=True, text=True,
                       timeout=900)
    if p.returncode:
        raise RuntimeError(f"{tag} failed:\n{p.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)["output_tokens_per_s"]


def run_async(side, ckpt, tmp) -> float:
    p = subprocess.run([sys.executable, "-c", ASYNC, ckpt, str(ARGS.requests),
                        str(ARGS.output_len)], cwd=tmp, env=env_of(side), capture_output=True,
                       text=True, timeout=900)
    if p.returncode:
        raise RuntimeError(f"AsyncLLM failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])["output_tokens_per_s"]


def main() -> None:
    sides = {"before": side_of(ARGS.before), "after": side_of(ARGS.after)}
    try:
        rows = _run(sides)
    finally:
        unlink(sides)
    _report(sides, rows)


def _run(sides: dict) -> dict:
    tmp = tempfile.mkdtemp(prefix="route_ab_")
    ckpt = make_tiny("mixtral", os.path.join(tmp, "ckpt"), seed=0, chat_template=False, **SHAPE)
    prompts = os.path.join(tmp, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(ARGS.requests):
            f.write(json.dumps({"id": f"q{i}", "prompt_token_ids":
                                [3 + (i * 7 + j) % 2000 for j in range(16 + i % 32)]}) + "\n")
    runs = {w: {s: [] for s in sides} for w in WORKLOADS}
    for k in range(ARGS.rounds):
        order = ["before", "after"] if k % 2 == 0 else ["after", "before"]
        for w, spec in WORKLOADS.items():
            for s in order:
                tag = f"{w.replace(' ', '_')}_{s}_{k}"
                v = (run_async(sides[s], ckpt, tmp) if spec is None else
                     run_offline(sides[s], spec[0], spec[1], ckpt, prompts, tmp, tag))
                runs[w][s].append(v)
                print(f"round {k} {w:16s} {s:6s} {v:8.1f} tok/s", flush=True)
    rows = {}
    for w, by in runs.items():
        b, a = statistics.median(by["before"]), statistics.median(by["after"])
        rows[w] = {"before_tok_s": b, "after_tok_s": a, "after_over_before": a / b,
                   "runs": by}
    return rows


def _report(sides: dict, rows: dict) -> None:
    print(f"\n{'workload':18s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
    for w, r in rows.items():
        print(f"{w:18s} {r['before_tok_s']:10.1f} {r['after_tok_s']:10.1f} "
              f"{r['after_over_before']:13.3f}")
    write_json(os.path.join(RESULTS, "bench_route_ab.json"), {
        "what": "output tokens/s, medians over alternating rounds; offline: the job's own "
                "summary (start-up excluded), AsyncLLM: concurrent generate calls",
        "sides": sides, "rounds": ARGS.rounds, "requests": ARGS.requests,
        "output_len": ARGS.output_len, "shape": SHAPE, "sizes": SIZES, "threads_per_rank": 1,
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "results": rows})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the other checkout's root")
    ap.add_argument("--after", default=ROOT, help="this checkout (default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ARGS = ap.parse_args()
    main()
