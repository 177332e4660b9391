"""``megainfer-serve``: the Hydra front door of the HTTP server (docs/serve.md).

The launcher's config tree (``conf/config.yaml``: model, deploy, scheduler, cache, ...) plus the
``serve`` group (``conf/serve/default.yaml`` -> ``megainfer.config.ServeConfig``); everything but
``serve.*`` resolves through ``settings_from_config`` exactly as for ``megainfer-launch``. Single
mode only for now: another deploy mode (or a world size above 1) is refused with
``ModeNotServedError``, before any weight is loaded.
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from megainfer.config import ConfigError, ServeConfig
from megainfer.config.keys import field_names, take
from megainfer.engine import RequestError

from megainfer.serve.server import check_servable

from .settings import settings_from_config
from .world import local_rank, local_ranks, world_size


def serve_settings(cfg):
    """The composed config -> (JobSettings, ServeConfig), validated."""
    c = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    c.pop("hydra", None)
    mode = (c.get("deploy") or {}).get("mode", "auto")
    if world_size() > 1 or mode not in ("single", "auto"):  # before any planning or loading
        check_servable(mode, world_size())
    serve = ServeConfig(**take("serve", c.pop("serve", None) or {}, field_names(ServeConfig)))
    return settings_from_config(c, world_size(), local_ranks(), local_rank()), serve


def run_server(cfg) -> int:
    from megainfer.serve.server import serve_engine, served_name
    s, serve = serve_settings(cfg)
    check_servable(s.deploy.mode, world_size())
    import torch
    torch.set_num_threads(s.cpu_threads)
    from megainfer.llm import LLM
    llm = LLM.from_job(s)
    return serve_engine(llm.engine, serve, s.load.path,
                        served_name(serve, cfg.model.get("path"), s.model.family))


@hydra.main(config_path="pkg://megainfer.conf", config_name="serve", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    try:
        code = run_server(cfg)
    except (ConfigError, RequestError) as e:
        print(f"[serve] error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        code = 2
    if code:
        sys.exit(code)


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
