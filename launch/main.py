"""``megainfer-launch``: the Hydra front door of the offline job (DESIGN §6).

World size 1 (no mpirun) runs ``deploy.mode=single`` in this process. Other modes go through
``run_distributed`` (the runtime's entry; not part of this build yet).
"""
from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from megainfer.config import ConfigError
from megainfer.engine import RequestError

from .inputs import job_requests
from .job import run_offline_job, write_summary
from .settings import JobSettings, settings_from_config
from .world import local_ranks, world_rank, world_size

log = logging.getLogger("megainfer.launch")


def single_generator(s: JobSettings):
    from megainfer.llm import LLM
    return LLM.from_configs(s.model, s.load, s.scheduler, s.cache, seed=s.seed)


def run_distributed(s: JobSettings, requests, output_path: str):
    raise ConfigError(f"deploy.mode={s.deploy.mode!r}: the distributed runtime is not part of "
                      "this build yet; run without mpirun (deploy.mode=single)")


def run_job(cfg, run_dir: str) -> int:
    s = settings_from_config(cfg, world_size(), local_ranks())
    import torch
    torch.set_num_threads(s.cpu_threads)
    out = s.io.output or os.path.join(run_dir, "generations.jsonl")
    requests = job_requests(s)
    log.info("[launch] %s: %d requests, model %s (%s weights), %d cpu threads, output %s",
             s.deploy.mode, len(requests), s.model.family, s.load.load_format, s.cpu_threads, out)
    if s.deploy.mode != "single":
        return run_distributed(s, requests, out)
    summary = run_offline_job(requests, single_generator(s), out, resume=s.io.resume,
                              progress=s.io.progress)
    print(f"[launch] summary ({s.deploy.mode})\n{summary.table()}", flush=True)
    write_summary(summary, os.path.join(run_dir, "summary.json"))
    return 0


@hydra.main(config_path="pkg://megainfer.conf", config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    try:
        code = run_job(cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, RequestError) as e:
        print(f"[launch rank{world_rank()}] error: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        code = 2
    if code:
        sys.exit(code)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
