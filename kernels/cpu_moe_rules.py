"""Which CPU path runs a routed-expert layer (``torch_moe.fused_moe_torch``): a table per
model dtype and thread count, keyed by the layer's rows (tokens), measured by
``perf/bench/tune_cpu_moe.py`` into ``cpu_moe_rules.json`` and read once.

Methods: ``per_expert`` (``torch_moe.grouped_moe`` / ``one_row_moe``: one GEMM pair per
expert with slots, through ``cpu_gemm``'s measured GEMM over oneDNN-packed weights) and
``grouped_mm`` (``torch_moe.grouped_mm_moe``: one ``torch._grouped_mm`` over every local
expert for gate/up and one for down). A table entry is ``{"float32": {"1": [[max_rows or
None, method], ...]}}``, rows ascending, a None catch-all last (``cpu_gemm``'s form). A dtype
missing from the table, or no table file, takes ``DEFAULT``: ``per_expert`` throughout.
docs/kernels.md, "CPU torch path".
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from .rule_tables import KeyedRules

METHODS = ("per_expert", "grouped_mm")
RULES_PATH = Path(__file__).with_name("cpu_moe_rules.json")
KEYS = ("float32", "bfloat16")  # the model dtypes torch._grouped_mm runs on CPU
DEFAULT = {key: {"1": [[None, "per_expert"]]} for key in KEYS}


class CpuMoeRuleError(ValueError):
    """A rule table is malformed; the message names the entry."""


def rule_key(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": a table key."""
    return str(dtype).removeprefix("torch.")


_KEYED = KeyedRules(KEYS, DEFAULT, RULES_PATH, METHODS, CpuMoeRuleError, "cpu moe rules")


# KeyedRules' check (CpuMoeRuleError names a bad entry) and use (keys missing take DEFAULT's)
check_rules, use_rules = _KEYED.check, _KEYED.use


def method_for(dtype: torch.dtype, rows: int, threads: Optional[int] = None) -> str:
    """The method for a layer of ``rows`` tokens in ``dtype`` at ``threads`` (default: torch's):
    the entry of the largest thread key <= threads (the smallest key if none is)."""
    return _KEYED.method(rule_key(dtype), rows, threads)


def forced(method: str) -> dict:
    """A table choosing ``method`` at every rows, dtype and thread count (tests, tuner)."""
    if method not in METHODS:
        raise CpuMoeRuleError(f"cpu moe rules: method {method!r} not in {METHODS}")
    return {key: {"1": [[None, method]]} for key in KEYS}
