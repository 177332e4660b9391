"""megainfer-plan: Hydra front door of the performance model (config -> dataclasses -> perfmodel).

  megainfer-plan model=mixtral_8x22b hardware=h100 slo.tpot_ms=100
  megainfer-plan model.path=DIR hardware=h100          # a checkpoint's config.json
  megainfer-plan calibrate [model=cpu_small calibrate.out=cpu_node.yaml]

The model: ``model=NAME`` of conf/plan_model/ (shape presets), or of the launcher's conf/model/
(``model=tiny``: its ``arch``), or ``model.path=DIR`` (a checkpoint: every family, DeepSeek's
latent cache included, through ``megainfer.perfmodel.plan.auto_plan.model_shape``).
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

import hydra
import yaml
from omegaconf import DictConfig, OmegaConf

import megainfer.conf
from megainfer.calibration.calibrate import calibrate, merge_profile, remeasure_node, write_profile
from megainfer.config import ConfigError
from megainfer.config.model_source import model_config_of
from megainfer.perfmodel.model.disagg import Workload
from megainfer.perfmodel.model.hardware import load_hardware, profile_from_dict
from megainfer.perfmodel.model.shapes import ModelShape
from megainfer.perfmodel.model.weight_format import with_weight_format
from megainfer.perfmodel.plan.api import PlanOptions, run_goodput, run_plan, run_world_serving
from megainfer.perfmodel.plan.auto_plan import model_shape
from megainfer.perfmodel.plan.goodput import Slo
from megainfer.perfmodel.plan.goodput_search import GoodputSpace, Roles
from megainfer.perfmodel.plan.planner import SearchSpace
from megainfer.perfmodel.sim.events import LengthDist, poisson_requests, read_request_trace

CONF_DIR = os.path.dirname(os.path.abspath(megainfer.conf.__file__))
SOURCE_KEYS = ("path", "launch_preset")  # where the shape comes from, when not the preset
# the plan table's columns, in one line (printed under each table)
LEGEND = ("T_a/T_e: attention/expert time of one micro-batch in one layer; T_c: its one-way "
          "transfer; m: micro-batches; B: global batch; binding: what caps B")


def _names(group: str) -> set[str]:
    d = os.path.join(CONF_DIR, group)
    return {f[:-5] for f in os.listdir(d) if f.endswith(".yaml")}


def presets(group: str, *shadowing: str) -> str:
    """The YAML names of conf/<group>/ but those of the ``shadowing`` groups (help text)."""
    return ", ".join(sorted(_names(group).difference(*map(_names, shadowing))))


OmegaConf.register_new_resolver("plan_presets", presets, replace=True)


def _model_config(m: dict):
    """The ModelConfig of ``model.path`` or ``model.launch_preset``, with the shape's name."""
    if m.get("path"):
        path = os.path.expanduser(str(m["path"]))
        return model_config_of({"path": path}), os.path.basename(os.path.normpath(path))
    f = os.path.join(CONF_DIR, "model", f"{m['launch_preset']}.yaml")
    with open(f) as fh:
        return model_config_of(yaml.safe_load(fh) or {}), str(m["launch_preset"])


def _shape(cfg: DictConfig):
    d = OmegaConf.to_container(cfg.model, resolve=True)
    cache = cfg.get("cache", {})
    kv = {"kv_cache_dtype": d.get("kv_cache_dtype", cache.get("kv_cache_dtype", "auto")),
          "kv_scale_granularity": d.get("kv_scale_granularity",
                                        cache.get("kv_scale_granularity", "token_head"))}
    q, group = d.get("quantization"), d.get("quantization_group_size", 64)
    if any(d.get(k) for k in SOURCE_KEYS):
        mc, name = _model_config(d)
        path = os.path.expanduser(str(d["path"])) if d.get("path") else None
        return with_weight_format(replace(model_shape(mc, name), **kv), q, group, path)
    d.update(kv)
    return ModelShape.from_dict({k: v for k, v in d.items() if k != "name" and k not in SOURCE_KEYS},
                                d.get("name", "model"))


def _echo(text: str) -> None:
    """print, and the legend under each plan table (its header ends in "binding")."""
    print(text)
    if text.split("\n", 1)[0].rstrip().endswith("binding"):
        print(LEGEND)


def _run(cfg: DictConfig) -> None:
    shape = _shape(cfg)
    if cfg.command == "calibrate":
        c = cfg.calibrate
        if c.get("node_only", False):  # re-measure only the node section of an existing profile
            prof = remeasure_node(str(c.out), shape, c.bench, c.threads, c.smoke)
            write_profile(prof, c.out)
            _print_node(prof)
            print(f"[calibrate] wrote {c.out} (node section only)")
            return
        prof = calibrate(shape, c.threads, c.smoke, c.bench, price_per_hour=c.price_per_hour, mpi=c.mpi,
                         node=c.get("node", True))
        prof["name"] = os.path.basename(str(c.out)).rsplit(".", 1)[0]  # hardware=<this name> finds it
        if c.get("merge", True):
            prof = merge_profile(prof, str(c.out))
        write_profile(prof, c.out)
        f = prof["fits"][shape.name]
        print(f"[calibrate] matmul {prof['matmul_flops']['float32'] / 1e9:.1f} GFLOP/s, memcpy "
              f"{prof['mem_bw_Bps'] / 1e9:.1f} GB/s, MPI latency {prof['inter_link']['latency_s'] * 1e6:.1f} us, "
              f"bandwidth {prof['inter_link']['bandwidth_Bps'] / 1e9:.2f} GB/s")
        print(f"[calibrate] {shape.name}: T_a = {f['k2'] * 1e6:.1f} us + b * ({f['k1'] * 1e6:.2f} us + "
              f"{f['k1_ctx'] * 1e9:.3f} ns * ctx), T_e = {f['k4'] * 1e6:.1f} us + {f['k3'] * 1e6:.2f} us * b_e")
        _print_node(prof)
        print(f"[calibrate] wrote {c.out}")
        return
    if cfg.command != "plan":
        raise ConfigError(f"command={cfg.command!r}: must be plan or calibrate")
    hw = OmegaConf.to_container(cfg.hardware, resolve=True)
    profiles = [profile_from_dict(hw, hw.get("name", "hardware"))]
    if cfg.expert_hardware:
        profiles.append(load_hardware(str(cfg.expert_hardware)))
    s = cfg.search
    space = SearchSpace(tpot_slo_s=float(cfg.slo.tpot_ms) / 1e3, tp_choices=tuple(s.tp_choices),
                        replica_choices=tuple(s.replica_choices), micro_batches=tuple(s.micro_batches),
                        expert_ranks=tuple(s.expert_ranks), max_batch=int(s.max_batch),
                        devices_per_node=int(s.devices_per_node), max_devices=int(s.max_devices))
    opt = PlanOptions(dtype=cfg.dtype, heterogeneous=bool(cfg.heterogeneous), use_fit=bool(cfg.use_fit),
                      colocated=bool(cfg.colocated), top=int(cfg.top), out_dir=cfg.out.dir,
                      timeline=bool(cfg.out.timeline), timeline_layers=int(cfg.out.timeline_layers),
                      jitter_s=float(cfg.sim.jitter_us) / 1e6, routing=cfg.sim.routing,
                      skew=float(cfg.sim.skew), seed=int(cfg.sim.seed))
    if cfg.workload.get("arrival_rate") is not None or cfg.workload.get("trace"):
        _run_goodput(cfg, shape, profiles[0], space, opt)
        return
    run_plan(shape, profiles, Workload(int(cfg.workload.input_len), int(cfg.workload.output_len)),
             space, opt, echo=_echo)


def _run_goodput(cfg: DictConfig, shape, hw, space, opt) -> None:
    w, g, s = cfg.workload, cfg.goodput, cfg.slo
    slo = Slo(float(s.ttft_ms) / 1e3, float(s.tpot_ms) / 1e3, float(s.percentile))
    if w.get("trace"):
        reqs = read_request_trace(str(w.trace))
    else:
        rate = float(w.arrival_rate)
        if not (rate > 0):
            raise ConfigError(f"workload.arrival_rate={w.arrival_rate!r}: must be > 0 requests/s")

        def dist(key, value):
            d = dict(OmegaConf.to_container(w[key], resolve=True))
            try:
                return LengthDist(value=float(value), **d)
            except ConfigError as e:
                raise ConfigError(f"workload.{key}: {e}") from None
        reqs = poisson_requests(int(w.num_requests), rate, dist("prompt", w.input_len),
                                dist("output", w.output_len), int(cfg.sim.seed))
    if g.get("world_size") is not None:
        world = g.world_size
        if not (isinstance(world, int) and world >= 2):
            raise ConfigError(f"goodput.world_size={world!r}: must be an integer >= 2 (or null)")
        run_world_serving(shape, hw, reqs, slo, world, int(g.max_batch),
                          int(g.max_num_batched_tokens), opt.dtype, opt.use_fit, opt.top,
                          opt.out_dir, int(cfg.sim.seed))
        return
    r = cfg.role_hardware
    roles = Roles(*(load_hardware(str(r[k])) if r.get(k) else hw
                    for k in ("prefill", "attention", "experts")))
    gs = GoodputSpace(tp_choices=space.tp_choices, replica_choices=tuple(g.replica_choices),
                      prefill_replicas=tuple(g.prefill_replicas), micro_batches=space.micro_batches,
                      expert_ranks=space.expert_ranks, max_batch=int(g.max_batch),
                      devices_per_node=space.devices_per_node,
                      max_num_batched_tokens=int(g.max_num_batched_tokens), max_sims=int(g.max_sims),
                      keep=int(g.keep), families=tuple(g.families))
    run_goodput(shape, roles, reqs, slo, gs, opt.dtype, opt.use_fit, opt.top, opt.out_dir,
                int(cfg.sim.seed))


def _print_node(prof: dict) -> None:
    n = prof.get("node", {})
    if "contention" not in n:
        return
    h = n["hop_overhead_s"]
    print(f"[calibrate] node: {n['cores']} cores, two at once slow attention "
          f"{n['contention']['attention']:.3f}x, experts {n['contention']['expert']:.3f}x; host per "
          f"(layer, micro-batch) attention {h['attention']['base'] * 1e6:.0f} us + "
          f"{h['attention']['per_peer'] * 1e6:.0f} us/peer, expert {h['expert']['base'] * 1e6:.0f} us + "
          f"{h['expert']['per_peer'] * 1e6:.0f} us/peer; wake-up {n['wake_latency_s'] * 1e6:.0f} us")


@hydra.main(config_path=CONF_DIR, config_name="plan", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    try:
        _run(cfg)
    except ConfigError as e:  # bad input: one clear line naming the constraint, exit code 2
        print(f"megainfer-plan: error: {e}", file=sys.stderr)
        sys.exit(2)


def _is_preset(group: str, name: str) -> bool:
    return os.path.isfile(os.path.join(CONF_DIR, group, f"{name}.yaml"))


def _rewrite_argv(argv: list[str]) -> list[str]:
    """`calibrate` -> command=calibrate; `model=<preset>` -> plan_model@model=<preset>, or
    model.launch_preset=<name> for a model of the launcher's conf/model/ only (tiny)."""
    out = []
    for a in argv:
        if a == "calibrate":
            out.append("command=calibrate")
        elif a.startswith("model=") and "." not in a.split("=", 1)[0]:
            name = a.split("=", 1)[1]
            if not _is_preset("plan_model", name) and _is_preset("model", name):
                out.append(f"model.launch_preset={name}")
            else:
                out.append("plan_model@" + a)
        else:
            out.append(a)
    if "command=calibrate" in out and not any(a.startswith("plan_model@model=") for a in out):
        out.append("plan_model@model=cpu_small")  # a model this CPU can time
    return out


def main() -> None:
    sys.argv = [sys.argv[0]] + _rewrite_argv(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
