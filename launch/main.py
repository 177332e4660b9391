"""``megainfer-launch``: the Hydra front door of the offline job (DESIGN §6).

World size 1 (no mpirun) runs ``deploy.mode=single`` in this process. Under mpirun every rank
runs this too: ``run_distributed`` builds the rank's part with ``megainfer.runtime`` and rank 0
runs the same offline job over it.
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


class _RankStream:
    """Rank 0's view of the distributed runtime as a ``generate_stream`` generator."""

    def __init__(self, rank):
        self.rank = rank

    def generate_stream(self, requests):
        from megainfer.runtime.world import run_rank
        return run_rank(self.rank, requests)


def run_distributed(s: JobSettings, requests, output_path: str, run_dir: str) -> int:
    """Every rank builds its part; rank 0 runs the offline job, the others serve until stopped.
    Runtime knobs (``RuntimeConfig``) stay at their defaults here."""
    from megainfer.engine.tokenizer import load_tokenizer
    from megainfer.runtime.world import JobSpec, build_rank, run_rank
    job = JobSpec(s.model, s.load, s.scheduler, s.cache, s.deploy,
                  tokenizer=load_tokenizer(s.load.path, s.model.eos_token_id), seed=s.seed)
    rank = build_rank(job)
    try:
        if rank.role.rank != 0:
            run_rank(rank)
            return 0
        summary = run_offline_job(requests, _RankStream(rank), output_path, resume=s.io.resume,
                                  progress=s.io.progress)
    finally:
        rank.close()
    _report(s, summary, run_dir)
    return 0


def _report(s: JobSettings, summary, run_dir: str) -> None:
    print(f"[launch] summary ({s.deploy.mode})\n{summary.table()}", flush=True)
    write_summary(summary, os.path.join(run_dir, "summary.json"))


def run_job(cfg, run_dir: str) -> int:
    s = settings_from_config(cfg, world_size(), local_ranks())
    import torch
    torch.set_num_threads(s.cpu_threads)
    out = s.io.output or os.path.join(run_dir, "generations.jsonl")
    requests = job_requests(s) if world_rank() == 0 else []  # rank 0 hands them out
    log.info("[launch rank%d] %s: %d requests, model %s (%s weights), %d cpu threads, output %s",
             world_rank(), s.deploy.mode, len(requests), s.model.family, s.load.load_format,
             s.cpu_threads, out)
    if s.deploy.mode != "single":
        return run_distributed(s, requests, out, run_dir)
    summary = run_offline_job(requests, single_generator(s), out, resume=s.io.resume,
                              progress=s.io.progress)
    _report(s, summary, run_dir)
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
