"""Least-squares fits for the calibration: y = k*x + c, and y = c + x*(k + k_ctx*ctx)."""
from __future__ import annotations

import numpy as np

from megainfer.config import ConfigError


def _lstsq(a: np.ndarray, y: np.ndarray, relative: bool) -> np.ndarray:
    """Least squares; relative=True minimises the relative error sum(((a k - y) / y)^2)."""
    w = 1.0 / np.abs(y) if relative and np.all(y != 0) else np.ones_like(y)
    k, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    return k


def fit_line(xs, ys, relative: bool = False) -> tuple[float, float]:
    """Slope and intercept of y = k*x + c."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(x) < 2 or len(set(x.tolist())) < 2:
        raise ConfigError(f"fit_line: need >= 2 distinct x values, got {xs!r}")
    k, c = _lstsq(np.stack([x, np.ones_like(x)], 1), y, relative)  # columns [x, 1]
    return float(k), float(c)


def fit_attention(bs, ctxs, ys, relative: bool = False) -> tuple[float, float, float]:
    """(k1, k1_ctx, k2) of y = k2 + b*(k1 + k1_ctx*ctx); one ctx value: k1_ctx = 0."""
    b, c, y = (np.asarray(v, float) for v in (bs, ctxs, ys))
    if len(set(c.tolist())) < 2:
        k1, k2 = fit_line(b, y, relative)
        return k1, 0.0, k2
    k1, k1c, k2 = _lstsq(np.stack([b, b * c, np.ones_like(b)], 1), y, relative)  # [b, b*ctx, 1]
    return float(k1), float(k1c), float(k2)
