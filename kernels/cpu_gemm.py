"""CPU matmuls of the weights a decode step reads: ``y = x @ W.T`` through the GEMM measured
fastest for the step's row count and this process's thread count.

Methods: ``mm`` (``torch.mm(x, W.t())``, MKL), ``skinny`` (``torch.mm(W, x.t()).t()``) and
``onednn`` (``torch.ops.mkldnn._linear_pointwise`` over a weight reordered once by
``_reorder_linear_weight``; private ops whose schemas a test pins). Which runs for how many
rows: a table per weight kind (``expert``, ``dense``), activation dtype (``expert.bfloat16``,
``dense.bfloat16``: bf16's own, measured apart; absent, fp32's) and thread count,
``cpu_gemm_rules.json`` (``use_rules`` swaps it). Only float32/bfloat16 CPU weights take oneDNN. Reordered weights are
cached on the weight, keyed by storage, shape, strides and version counter; whoever writes
weights through ``.data`` calls ``forget_packed``.
docs/kernels.md, "CPU matmuls of dense and expert weights".
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from .rule_tables import RuleTables, check_table

METHODS = ("mm", "skinny", "onednn")
RULES_PATH = Path(__file__).with_name("cpu_gemm_rules.json")
KINDS = ("expert", "dense")
BF16_KINDS = tuple(f"{k}.bfloat16" for k in KINDS)  # bf16's own tables (else fp32's apply)
# before issue 38: experts weight-major for 3-16 rows (SKINNY=(3, 16)), everything else F.linear
OLD_RULES = {"expert": {"1": [[2, "mm"], [16, "skinny"], [None, "mm"]]},
             "dense": {"1": [[None, "mm"]]}}
_ATTR, _ATTR_CAT = "_megainfer_onednn", "_megainfer_onednn_cat"
# oneDNN's blocked inner-product runs fp32 and, on AVX512-BF16 cores, bf16 (2.4x bf16's
# F.linear at one row of a 2048 x 512 weight, 1.8x fp32's oneDNN: issue 50)
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


class CpuGemmRuleError(ValueError):
    """A rule table is malformed; the message names the entry."""


def check_rules(rules: dict) -> dict:
    """{kind: {threads: [[max_rows or None, method], ...]}} for every kind in KINDS (and
    optionally BF16_KINDS), rows ascending and a None catch-all last -> the same with int thread
    keys and tuple entries, a bf16 kind absent taking its fp32 kind's table."""
    if not set(KINDS) <= set(rules) <= set(KINDS + BF16_KINDS):
        raise CpuGemmRuleError(f"cpu gemm rules: kinds {sorted(rules)} must be {sorted(KINDS)}"
                               f" and optionally {sorted(BF16_KINDS)}")
    out = {kind: _check_kind(kind, rules[kind]) for kind in rules}
    for kind, bf in zip(KINDS, BF16_KINDS):
        out.setdefault(bf, out[kind])
    return out


def _check_kind(kind: str, rules: dict) -> dict:
    return check_table(rules, f"cpu gemm rules[{kind}]", METHODS, CpuGemmRuleError)


def _table_rules() -> dict:
    if not RULES_PATH.exists():  # an install without the measured table: oneDNN throughout
        return {kind: {1: [(None, "onednn")]} for kind in KINDS + BF16_KINDS}
    with open(RULES_PATH) as f:
        return check_rules(json.load(f)["rules"])


_RULES = RuleTables(_table_rules, check_rules)


def use_rules(rules: Optional[dict]):
    """Run a block under another rule table (``check_rules``' form); None: the measured table.
    ``use_rules(OLD_RULES)`` is the path before issue 38 (MKL; experts weight-major for 3-16
    rows)."""
    return _RULES.use(rules)


def method_for(rows: int, kind: str = "dense", threads: Optional[int] = None,
               dtype: torch.dtype = torch.float32) -> str:
    """The method for ``rows`` rows of a ``kind`` weight in ``dtype`` at ``threads`` (default:
    torch's) threads: the entry of the largest thread key <= threads (the smallest key if none
    is) of the dtype's table (bf16's own, else fp32's)."""
    return _RULES.method(f"{kind}.bfloat16" if dtype is torch.bfloat16 else kind, rows, threads)


@functools.lru_cache(maxsize=1)
def _mkldnn() -> bool:
    return torch.backends.mkldnn.is_available()


def onednn_ok(w: torch.Tensor) -> bool:
    return w.dtype in ONEDNN_DTYPES and w.is_cpu and _mkldnn()


def _version(w: torch.Tensor) -> int:
    try:
        return w._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return -1


def storage_key(w: torch.Tensor) -> tuple:
    """What a copy derived from ``w`` depends on: its storage, shape, strides and version."""
    return (w.data_ptr(), tuple(w.shape), tuple(w.stride()), _version(w))


def cached_on(owner: torch.Tensor, attr: str, key: tuple, build: Callable[[], tuple]) -> tuple:
    """``build()``'s result kept on ``owner`` under ``attr`` while ``key`` (``storage_key``s of
    what it was built from) stays the same; rebuilt once it changes."""
    cache = getattr(owner, attr, None)
    if cache is None or cache[0] != key:
        with torch.no_grad():
            cache = (key, build())
        setattr(owner, attr, cache)
    return cache[1]


def _packs(w: torch.Tensor) -> dict:
    """{index: reordered copy} cached on ``w`` for its current storage, shape, strides and
    version (a fresh, empty dict once any of them changed)."""
    cache = getattr(w, _ATTR, None)
    key = storage_key(w)
    if cache is None or cache[0] != key:
        cache = (key, {})
        setattr(w, _ATTR, cache)
    return cache[1]


def packed(w: torch.Tensor, index: Optional[int] = None) -> torch.Tensor:
    """The oneDNN-reordered copy of ``w`` [N, K] (``index``: of ``w[index]`` for a stacked
    [E, N, K] weight), made on first use and cached on ``w``."""
    packs = _packs(w)
    p = packs.get(index)
    if p is None:
        # a stacked weight packs every index the first time (at load, not over the first steps)
        todo = [index] if index is None or packs else range(w.shape[0])
        with torch.no_grad():
            for i in todo:
                src = w if i is None else w[i]
                packs[i] = torch.ops.mkldnn._reorder_linear_weight(src.detach().contiguous())
        p = packs[index]
    return p


def forget_packed(w: torch.Tensor, index: Optional[int] = None) -> None:
    """Drop ``w``'s reordered copies (``index``: only ``w[index]``'s) after writing it through
    ``.data``, which the version counter does not see."""
    cache = getattr(w, _ATTR, None)
    if hasattr(w, _ATTR_CAT):
        delattr(w, _ATTR_CAT)
    if cache is not None:
        if index is None:
            cache[1].clear()
        else:
            cache[1].pop(index, None)


def _onednn_linear(x: torch.Tensor, p: torch.Tensor, bias: Optional[torch.Tensor]):
    """x [n, K] fp32 @ the reordered weight ``p`` (+ bias) -> [n, N]."""
    return torch.ops.mkldnn._linear_pointwise(x if x.is_contiguous() else x.contiguous(), p,
                                              bias, "none", [], "")


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
           index: Optional[int] = None, kind: str = "dense") -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) -> [..., N]; ``index``: use ``w[index]`` of a stacked weight."""
    if x.dtype is not w.dtype or not onednn_ok(w):
        return F.linear(x, w if index is None else w[index], bias)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [n, K]
    y = _by_method(method_for(x2.shape[0], kind, dtype=x2.dtype), x2, w, index, bias)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def _by_method(method: str, x: torch.Tensor, w: torch.Tensor, index: Optional[int],
               bias: Optional[torch.Tensor], pack: Optional[torch.Tensor] = None):
    """x [n, K] fp32 @ w (or w[index]).T (+ bias) through ``method``; ``pack``: the reordered
    weight if the caller has it already."""
    if method == "onednn" and x.shape[0]:
        return _onednn_linear(x, packed(w, index) if pack is None else pack, bias)
    wi = w if index is None else w[index]
    if method == "skinny":
        y = torch.mm(wi, x.t()).t()
        return y if bias is None else y + bias
    return F.linear(x, wi, bias)


def stacked_linear(w: torch.Tensor,
                   kind: str = "expert") -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A stacked weight w [E, N, K] -> ``run(x, e)``: x [n, K] @ w[e].T -> [n, N], as ``linear(x,
    w, index=e, kind=kind)`` computes it, with the per-weight work (the pack cache's key, the
    thread count) done here once instead of once per expert: an MoE layer's expert loop."""
    if not onednn_ok(w):
        return lambda x, e: linear(x, w, index=e, kind=kind)
    threads, packs = torch.get_num_threads(), _packs(w)

    def run(x: torch.Tensor, e: int) -> torch.Tensor:
        if x.dtype is not w.dtype or x.dim() != 2:
            return linear(x, w, index=e, kind=kind)
        return _by_method(method_for(x.shape[0], kind, threads, x.dtype), x, w, e, None,
                          packs.get(e))
    return run


def linear_split(x: torch.Tensor, ws: Sequence[torch.Tensor],
                 biases: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 kind: str = "dense") -> list[torch.Tensor]:
    """[x @ w.T (+ b) for w, b in zip(ws, biases)]: one GEMM over the weights stacked along N
    (reordered once, cached on ``ws[0]``) when the rule says oneDNN, as views of its output;
    otherwise one ``linear`` per weight. x [T, K], ws[i] [N_i, K] -> [T, N_i] each."""
    biases = list(biases) if biases is not None else [None] * len(ws)
    w0 = ws[0]
    if (not onednn_ok(w0) or x.dtype != w0.dtype or x.dim() != 2 or not x.shape[0]
            or method_for(x.shape[0], kind, dtype=x.dtype) != "onednn"):
        return [linear(x, w, b, kind=kind) for w, b in zip(ws, biases)]
    def build():
        w = torch.cat([t.detach() for t in ws])  # [sum N_i, K]
        b = None if all(t is None for t in biases) else torch.cat(
            [t.detach() if t is not None else w.new_zeros(n.shape[0])
             for t, n in zip(biases, ws)])
        return torch.ops.mkldnn._reorder_linear_weight(w), b

    key = tuple(storage_key(t) for t in (*ws, *biases) if t is not None)
    w, b = cached_on(w0, _ATTR_CAT, key, build)
    y = _onednn_linear(x, w, b)
    return list(y.split([w.shape[0] for w in ws], dim=-1))
