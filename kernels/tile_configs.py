"""Tile configs of the Triton grouped GEMM, keyed by (E, N, K, M bucket, dtype, device).

Tuned entries live in ``tile_configs.json`` beside this file (written by
``perf/bench/tune_moe_kernels.py`` on a GPU); anything not in the table gets a default chosen by
tokens per expert. Under ``TRITON_INTERPRET=1`` every block is 32 (the interpreter is slow and
``tl.dot`` needs >= 16).
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Optional

import torch

TABLE_PATH = Path(__file__).with_name("tile_configs.json")
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def m_bucket(M: int) -> int:
    """The smallest bucket >= M (the largest bucket for anything bigger)."""
    return next((b for b in M_BUCKETS if b >= M), M_BUCKETS[-1])


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "_")
    return device.type


def table_key(E: int, N: int, K: int, M: int, dtype: torch.dtype, device: str) -> str:
    dt = str(dtype).removeprefix("torch.")
    return f"E={E},N={N},K={K},M={m_bucket(M)},dtype={dt},device={device}"


@functools.lru_cache(maxsize=1)
def load_table(path: str = str(TABLE_PATH)) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def default_config(E: int, M: int, top_k: int) -> dict:
    """vLLM-style defaults by tokens per expert: small tiles for decode, big for prefill."""
    per_expert = M * top_k / max(E, 1)
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    if per_expert <= 128:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def get_config(E: int, N: int, K: int, M: int, top_k: int, dtype: torch.dtype,
               device: torch.device, table: Optional[dict] = None) -> dict:
    """The tuned entry when there is one, else the default; all 32 under the interpreter."""
    if interpreting():
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    table = load_table() if table is None else table
    hit = table.get(table_key(E, N, K, M, dtype, device_name(device)))
    return dict(hit) if hit else default_config(E, M, top_k)
