"""Least-squares fits for the calibration: y = k*x + c, and y = c + x*(k + k_ctx*ctx)."""
from __future__ import annotations

import numpy as np

from megainfer.config import ConfigError


def fit_line(xs, ys) -> tuple[float, float]:
    """Slope and intercept of y = k*x + c."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(x) < 2 or len(set(x.tolist())) < 2:
        raise ConfigError(f"fit_line: need >= 2 distinct x values, got {xs!r}")
    a = np.stack([x, np.ones_like(x)], 1)  # [n, 2]
    (k, c), *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(k), float(c)


def fit_attention(bs, ctxs, ys) -> tuple[float, float, float]:
    """(k1, k1_ctx, k2) of y = k2 + b*(k1 + k1_ctx*ctx); one ctx value: k1_ctx = 0."""
    b, c, y = (np.asarray(v, float) for v in (bs, ctxs, ys))
    if len(set(c.tolist())) < 2:
        k1, k2 = fit_line(b, y)
        return k1, 0.0, k2
    a = np.stack([b, b * c, np.ones_like(b)], 1)  # [n, 3]
    (k1, k1c, k2), *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(k1), float(k1c), float(k2)
