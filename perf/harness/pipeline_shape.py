"""The pipeline bench's model and batch (``perf/jobs/pipeline_job.py`` arguments), shared by
bench_pipeline, the in-situ calibration, the runtime runs and the simulator validation."""

# attention and expert time comparable at decode (T_a ~ T_e), experts big enough per micro-batch
# that their time scales with tokens: 4 experts top-2, 8 layers, batch 192 (extra args override)
BENCH_SHAPE = ["--batch", "192", "--experts", "4", "--inter", "896", "--layers", "8",
               "--vocab", "512", "--kv-heads", "8", "--decode", "12"]
PROMPT, DECODE = 16, 12  # the runtime runs' prompt and decode lengths (measure_runtime_runs)


def job_args(batch: int, replicas: int = 1) -> list:
    """pipeline_job.py arguments after its configs: BENCH_SHAPE at this batch and replica count."""
    return [*BENCH_SHAPE, "--batch", batch, "--replicas", replicas, "--prompt", PROMPT,
            "--decode", DECODE]
