"""``megainfer-launch``: the Hydra front door of the offline job (docs/engine.md).

World size 1 (no mpirun) runs ``deploy.mode=single`` in this process. Under mpirun every rank
runs this too: ``launch/distributed.py`` builds the rank's part of the job. Only rank 0 keeps a
Hydra run directory and logs at INFO; the other ranks log warnings and errors only. A start-up
failure (Hydra refusing the command line, a bad setting) is printed once, by rank 0
(``launch/startup_errors.py``).
"""
from __future__ import annotations

import logging
import os
import sys

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from megainfer.config import ConfigError
from megainfer.engine import RequestError
from megainfer.llm import LLM

from . import startup_errors
from .inputs import job_requests
from .job import run_offline_job, write_summary
from .overrides import job_config_text, override_key_error, wants_job_config
from megainfer.engine.job_doors import JobSettings, settings_from_config
from megainfer.engine_core.launch_env import local_rank, local_ranks, world_rank, world_size

log = logging.getLogger("megainfer.launch")


def single_generator(s: JobSettings):
    return LLM.from_job(s)


def run_job(s: JobSettings, run_dir: str) -> int:
    torch.set_num_threads(s.cpu_threads)
    out = s.io.output or os.path.join(run_dir, "generations.jsonl")
    requests = job_requests(s) if world_rank() == 0 else []  # rank 0 hands them out
    log.info("[launch] %s: %d requests, model %s (%s weights, %s), device %s, %d cpu threads, "
             "output %s", s.deploy.mode, len(requests), s.model.family, s.load.load_format,
             s.load.dtype, s.device.torch_device, s.cpu_threads, out)
    if s.deploy.mode != "single":
        from .distributed import run_distributed  # imports MPI: single mode never starts it
        return run_distributed(s, requests, out, run_dir)
    summary = run_offline_job(requests, single_generator(s), out, resume=s.io.resume,
                              progress=s.io.progress)
    print(f"[launch] summary ({s.deploy.mode})\n{summary.table()}", flush=True)
    write_summary(summary, os.path.join(run_dir, "summary.json"))
    return 0


_held: startup_errors.HeldStderr | None = None  # stderr held back while Hydra composes


@hydra.main(config_path="pkg://megainfer.conf", config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    if _held is not None:
        sys.stderr.write(_held.release())  # composed: what Hydra printed so far was no error
    failure = None
    try:
        s = settings_from_config(cfg, world_size(), local_ranks(), local_rank())
    except ConfigError as e:
        failure = startup_errors.config_error_line(e)
    if startup_errors.report(startup_errors.agree(failure)):
        sys.exit(2)
    try:
        code = run_job(s, HydraConfig.get().runtime.output_dir)
        if not code and world_size() > 1:
            from megainfer.runtime.startup import finish_job
            code = finish_job(f"[launch rank{world_rank()}]")
    except (ConfigError, RequestError) as e:
        print(f"[launch rank{world_rank()}] error: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        code = 2
    if code:
        sys.exit(code)


# ranks other than 0 share rank 0's run directory: no directory, .hydra or log file of their own
_FOLLOWER_OVERRIDES = ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none",
                       "hydra/hydra_logging=none"]


def main() -> None:
    global _held
    # a key no group reads, refused before Hydra (whose `+key` advice is wrong here) with the
    # exit code of a refused command line (1, as Hydra's; a bad value found later exits 2)
    bad = override_key_error(sys.argv[1:])
    if startup_errors.report(startup_errors.agree(
            None if bad is None else startup_errors.config_error_line(bad))):
        sys.exit(1)
    if wants_job_config(sys.argv[1:]):
        print(job_config_text(sys.argv[1:]), end="")
        return
    runs_job = not any(a.startswith("-") for a in sys.argv[1:])  # not --help, --cfg, ...
    if world_size() > 1 and world_rank() != 0 and runs_job:
        sys.argv += _FOLLOWER_OVERRIDES
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if not (runs_job and world_size() > 1):
        _hydra_main()
        return
    _held = startup_errors.HeldStderr()
    with _held:
        try:
            _hydra_main()
        except SystemExit as e:
            if _held.released or not e.code:
                raise
            text = _held.release()  # Hydra refused the command line: rank 0 says it once
            startup_errors.report(startup_errors.agree(text or f"[launch] exit {e.code}"))
            raise


if __name__ == "__main__":
    main()
