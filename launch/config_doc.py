"""Every config key once (group, type, default, meaning) -> Markdown: ``docs/config.md``.

    python -m megainfer.launch.config_doc > docs/config.md

Keys come from the launcher's YAML (``conf/config.yaml`` and every preset of each group) and
from the frozen dataclasses each group is validated into; types and dataclass defaults from
those dataclasses; defaults shown are what ``megainfer-launch`` composes (its default presets).
A meaning is the field's comment in the dataclass source (a trailing ``# ...`` or the comment
lines just above it), else the key's comment in the YAML. A key with neither is an error, so a
new key cannot land undocumented (``tests/unit/launch/test_config_doc.py`` also checks the file is current).
Reads YAML with PyYAML and comments line by line: no Hydra.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize
from typing import Optional

import yaml

import megainfer.conf
from megainfer.config import (CacheConfig, CommConfig, DeployPlan, DeviceConfig, EplbConfig,
                              LoadConfig, ModelConfig, PdConfig, ReplanConfig, SchedulerConfig, ServeConfig,
                              SloConfig, TraceConfig)
from megainfer.engine.sampling_params import SamplingParams
from megainfer.config.offline_job import IOSettings, WorkloadSettings
from megainfer.engine.job_doors import JobSettings

CONF = os.path.dirname(os.path.abspath(megainfer.conf.__file__))

# group -> (the dataclass whose fields are the group's keys, further dataclasses a key may be a
# field of, what the group is)
GROUPS = {
    "model": (LoadConfig, (DeviceConfig,), "which checkpoint and how it is loaded"),
    "deploy": (DeployPlan, (DeviceConfig, JobSettings), "how the ranks are split"),
    "scheduler": (SchedulerConfig, (), "the token budget per step and request routing"),
    "cache": (CacheConfig, (), "the paged KV cache"),
    "sampling": (SamplingParams, (), "the job's default sampling (vLLM names)"),
    "io": (IOSettings, (), "input and output files"),
    "workload": (WorkloadSettings, (), "built-in prompts when io.input is null"),
    "engine": (None, (DeviceConfig,), "the engine on cuda"),
    "comm": (CommConfig, (), "the M2N/N2M layer and the control plane"),
    "trace": (TraceConfig, (), "pipeline traces"),
    "eplb": (EplbConfig, (), "expert-parallel load balancing"),
    "replan": (ReplanConfig, (), "online re-planning of the attention:expert split"),
    "slo": (SloConfig, (), "the serving target deploy=auto plans for"),
    "pd": (PdConfig, (), "prefill-decode options: decode attention offloaded to the prefill ranks"),
    "serve": (ServeConfig, (), "megainfer-serve's HTTP server (docs/serve.md)"),
}
# launcher keys that are no dataclass field: key -> (type, meaning source is the YAML comment)
EXTRA_TYPES = {"model.arch": "mapping (ModelConfig fields)", "deploy.hardware": "str | null",
               "model.revision": "str | null", "cache.gpu_memory_utilization": "float | null",
               "cache.memory_gib": "float"}
PLAN_NULL_TYPES = {"workload.arrival_rate": "float | null", "goodput.world_size": "int | null"}  # plan.yaml keys whose default is null
# fields of a key class that are not keys, and keys read from another class's field
NOT_KEYS = {"DeviceConfig.index"}
RENAMED = {"deploy.device": "device", "deploy.cpu_threads": "cpu_threads",
           "model.attention_backend": "attention_backend", "engine.cuda_graphs": "cuda_graphs"}


def field_comments(cls) -> dict:
    """A dataclass's field name -> its comment in the source: the trailing ``# ...`` of the
    field's line, else the comment lines right above it (joined)."""
    src = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = src.splitlines()
    out = {}
    for i, line in enumerate(lines, start=1):
        m = re.match(r"    (\w+)\s*:", line)
        if not m or m.group(1) not in {f.name for f in dataclasses.fields(cls)}:
            continue
        name = m.group(1)
        if i in comments and not line.lstrip().startswith("#"):
            out[name] = comments[i]
            continue
        above, j = [], i - 1
        while j >= 1 and lines[j - 1].lstrip().startswith("#"):
            above.insert(0, comments[j])
            j -= 1
        if above:
            out[name] = " ".join(above)
    return out


def yaml_comments(path: str) -> dict:
    """A YAML file's dotted key -> its trailing comment (two-space indented nesting)."""
    out, stack = {}, []
    with open(path) as f:
        for line in f:
            m = re.match(r"( *)([A-Za-z_]\w*):(.*)$", line.rstrip("\n"))
            if not m:
                continue
            depth = len(m.group(1)) // 2
            stack[depth:] = [m.group(2)]
            rest = m.group(3)
            if "#" in rest:
                out[".".join(stack)] = rest.split("#", 1)[1].strip()
    return out


def _flatten(d: dict, prefix: str = "", keep: tuple = ()) -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in keep:
            out.update(_flatten(v, key + ".", keep))
        else:
            out[key] = v
    return out


def launch_presets() -> tuple[dict, dict, dict]:
    """(group -> default preset's values, group -> {key: comment} over every preset,
    group -> sorted key list over every preset) of ``megainfer-launch``'s YAML."""
    with open(os.path.join(CONF, "config.yaml")) as f:
        top = yaml.safe_load(f)
    chosen = {}
    for item in top["defaults"]:
        if isinstance(item, dict):
            chosen.update(item)
    values, notes, keys = {}, {}, {}
    for group in GROUPS:
        notes[group], keys[group] = {}, set()
        if group in chosen:
            d = os.path.join(CONF, group)
            for name in sorted(os.listdir(d)):
                if not name.endswith(".yaml"):
                    continue
                with open(os.path.join(d, name)) as f:
                    data = yaml.safe_load(f) or {}
                keys[group] |= set(data)
                for k, c in yaml_comments(os.path.join(d, name)).items():
                    notes[group].setdefault(k, c)
                if name == f"{chosen[group]}.yaml":
                    values[group] = data
        else:
            values[group] = top.get(group) or {}
            keys[group] |= set(values[group])
            for k, c in yaml_comments(os.path.join(CONF, "config.yaml")).items():
                if k.startswith(group + "."):
                    notes[group][k[len(group) + 1:]] = c
    return values, notes, keys


def _type(t) -> str:
    s = str(t).replace("typing.", "").replace("tuple[int, ...]", "list[int]")
    s = s.replace("tuple[str, ...]", "list[str]")
    s = "list" if s == "tuple" else s
    m = re.fullmatch(r"Optional\[(.*)\]", s)
    if m:
        s = f"{m.group(1)} | null"
    m = re.fullmatch(r"Union\[(.*)\]", s)
    if m:
        s = " | ".join(p.strip() for p in m.group(1).split(",")).replace("None", "null")
    return s


def _value(v) -> str:
    if v is dataclasses.MISSING:
        return "required"
    if isinstance(v, dict):
        return "(preset)"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        text = "[" + ", ".join(_value(x) for x in v) + "]"
        return text if len(text) <= 60 else f"[{len(v)} items]"
    return str(v)


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _find(key: str, classes) -> Optional[dataclasses.Field]:
    name = RENAMED.get(key, key.split(".", 1)[1])
    for cls in classes:
        if cls is None:
            continue
        for f in dataclasses.fields(cls):
            if f.name == name and f"{cls.__name__}.{f.name}" not in NOT_KEYS:
                return f, cls
    return None


def launch_rows() -> dict:
    """group -> [(key, type, default, meaning)] for every ``megainfer-launch`` key."""
    values, notes, keys = launch_presets()
    rows = {}
    for group, (main, others, _) in GROUPS.items():
        names = set(keys[group])
        if main is not None:
            names |= {f.name for f in dataclasses.fields(main)}
        rows[group] = []
        for name in sorted(names):
            key = f"{group}.{name}"
            found = _find(key, (main,) + others)
            if found is None and key not in EXTRA_TYPES:
                raise ValueError(f"{key}: no dataclass field and no entry in EXTRA_TYPES")
            meaning = notes[group].get(name)
            if found is not None:
                f, cls = found
                meaning = field_comments(cls).get(f.name) or meaning
                typ = _type(f.type)
                default = values[group].get(name, f.default if f.default_factory is
                                            dataclasses.MISSING else f.default_factory())
            else:
                typ, default = EXTRA_TYPES[key], values[group].get(name)
            if default is None and "null" not in typ:
                typ += " | null"
            if not meaning:
                raise ValueError(f"{key}: no meaning (add a comment to the dataclass field or "
                                 "the YAML key)")
            rows[group].append((key, typ, _value(default), meaning))
    return rows


def arch_rows() -> list:
    """``model.arch.*``: ModelConfig's fields (the dummy model's architecture)."""
    notes = field_comments(ModelConfig)
    out = []
    for f in dataclasses.fields(ModelConfig):
        if f.name not in notes:
            raise ValueError(f"ModelConfig.{f.name}: no comment (add one in megainfer/config/model.py)")
        out.append((f"model.arch.{f.name}", _type(f.type), _value(f.default), notes[f.name]))
    return out


def plan_rows() -> list:
    """``megainfer-plan``'s own keys (conf/plan.yaml), its two preset groups first."""
    path = os.path.join(CONF, "plan.yaml")
    with open(path) as f:
        data = yaml.safe_load(f)
    notes = yaml_comments(path)
    data.pop("defaults", None)
    data.pop("hydra", None)
    out = [("hardware", "preset", "a100_80g", "a hardware profile from conf/hardware/ (or a .yaml path)"),
           ("model", "preset", "mixtral_8x22b", "a shape preset from conf/plan_model/; model.<field>=... overrides one number")]
    for key, v in _flatten(data, keep=("workload.prompt", "workload.output")).items():
        meaning = notes.get(key)
        if not meaning:
            raise ValueError(f"plan.yaml {key}: no comment")
        typ = ("mapping" if isinstance(v, dict) else "list" if isinstance(v, list) else
               PLAN_NULL_TYPES.get(key, "str | null") if v is None else type(v).__name__)
        out.append((key, typ, _value(v) if not isinstance(v, dict) else
                    "{" + ", ".join(f"{a}: {_value(b)}" for a, b in v.items()) + "}", meaning))
    return out


def _table(rows) -> list:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {_cell(t)} | `{_cell(d)}` | {_cell(m)} |" for k, t, d, m in rows]
    return lines


def render() -> str:
    out = ["# Config keys",
           "",
           "<!-- Generated by `python -m megainfer.launch.config_doc > docs/config.md`; do not edit."
           " tests/unit/launch/test_config_doc.py fails when this file is stale. -->",
           "",
           "Every key of `megainfer-launch` (set as `group.key=value`, `--cfg job` prints them "
           "composed) and of `megainfer-plan`, once. *Default* is what the launcher composes "
           "from its default presets (`conf/config.yaml`); a preset (`deploy=a1e2`, "
           "`model=bench50m`) changes several at once. Each group is validated into a frozen "
           "dataclass (`megainfer/config/`, `megainfer/config/offline_job.py`), whose errors name the key.",
           ""]
    rows = launch_rows()
    for group, (_, _, what) in GROUPS.items():
        out += [f"## `{group}`: {what}", ""] + _table(rows[group]) + [""]
        if group == "model":
            out += ["### `model.arch`: the dummy model's architecture (ignored with `model.path`)",
                    "", "`ModelConfig`'s fields, Hugging Face names where HF has one; a "
                    "checkpoint's `config.json` fills them otherwise.", ""]
            out += _table(arch_rows()) + [""]
    out += ["## `megainfer-plan` (`conf/plan.yaml`)", ""] + _table(plan_rows()) + [""]
    return "\n".join(out)


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
