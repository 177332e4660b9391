"""Which CPU op computes ``y = x @ W.T`` for a stored int8/int4 weight (``cpu_qgemm.py``): a
table per (format, activation dtype) and thread count, measured by
``perf/bench/tune_cpu_qgemm.py`` into ``cpu_qgemm_rules.json`` and read once.

Methods: ``weight_only`` (torch's weight-only kernel, ``_weight_int8pack_mm`` /
``_weight_int4pack_mm_for_cpu``: cheapest at a few rows, its cost grows row by row) and
``dequant`` (the weight dequantised into the activations' dtype for this call only, then
``F.linear``: a fixed cost, cheaper above some rows). A table entry is
``{"int8/bfloat16": {"1": [[max_rows or None, method], ...]}}``, rows ascending, a None
catch-all last (``cpu_gemm``'s form). A (format, dtype) missing from the table, or no table
file, takes ``DEFAULT``: weight-only up to 4 rows in bf16, dequantised above and always in
fp32 (the weight-only kernels run fp32 activations row by row, 10-100x slower).
docs/kernels.md, "CPU matmuls of dense and expert weights".
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from .rule_tables import KeyedRules

METHODS = ("weight_only", "dequant")
RULES_PATH = Path(__file__).with_name("cpu_qgemm_rules.json")
KEYS = ("int8/bfloat16", "int8/float32", "int4/bfloat16", "int4/float32")
DEFAULT = {"int8/bfloat16": {"1": [[4, "weight_only"], [None, "dequant"]]},
           "int4/bfloat16": {"1": [[4, "weight_only"], [None, "dequant"]]},
           "int8/float32": {"1": [[None, "dequant"]]},
           "int4/float32": {"1": [[None, "dequant"]]}}


class CpuQgemmRuleError(ValueError):
    """A rule table is malformed; the message names the entry."""


def rule_key(fmt_name: str, dtype: torch.dtype) -> str:
    """("int8", torch.bfloat16) -> "int8/bfloat16": a table key."""
    return f"{fmt_name}/{str(dtype).removeprefix('torch.')}"


_KEYED = KeyedRules(KEYS, DEFAULT, RULES_PATH, METHODS, CpuQgemmRuleError, "cpu qgemm rules")


# KeyedRules' check (CpuQgemmRuleError names a bad entry) and use (keys missing take DEFAULT's)
check_rules, use_rules = _KEYED.check, _KEYED.use


def method_for(fmt_name: str, dtype: torch.dtype, rows: int,
               threads: Optional[int] = None) -> str:
    """The method for ``rows`` rows of activations in ``dtype`` against a ``fmt_name`` weight
    at ``threads`` (default: torch's): the entry of the largest thread key <= threads (the
    smallest key if none is)."""
    return _KEYED.method(rule_key(fmt_name, dtype), rows, threads)
