"""The ping-pong pipeline rules of docs/design_rules.md (MegaScale-Infer §4), as plain functions of seconds.

T_a, T_e: attention / expert time of one micro-batch for one layer; T_c: one-way transfer;
T_f = max(T_a, T_e); R = T_a + T_e + 2 T_c is one micro-batch's round trip through a layer.
"""
from __future__ import annotations

from megainfer.config import ConfigError


def t_total_design(t_a: float, t_e: float, t_c: float, m: int, layers: int) -> float:
    """docs/design_rules.md: (T_a + T_e + 2 T_c) + T_f (m L - 1). Exact when comm is hidden (see below)."""
    return (t_a + t_e + 2 * t_c) + max(t_a, t_e) * (m * layers - 1)


def t_total(t_a: float, t_e: float, t_c: float, m: int, layers: int) -> float:
    """Iteration time in every regime (the simulator's exact answer with no jitter).

    The pipeline is a four-stage flow shop (attention, A2E, expert, E2A) of m*L identical jobs in
    which job (i, l) is released when job (i, l-1) leaves E2A. With T_s = max(T_a, T_e, T_c) the
    last job finishes at max(R + (mL - 1) T_s, L R + (m - 1) T_s): the first term when the
    pipeline stays full (m T_s >= R, i.e. m >= 2 (1 + T_c / T_f) when T_a = T_e), the second when
    every micro-batch waits on its own round trip. With T_c <= T_f and m T_f >= R it equals
    t_total_design.
    """
    if m < 1 or layers < 1:
        raise ConfigError(f"t_total: m={m}, layers={layers} must be >= 1")
    r = t_a + t_e + 2 * t_c
    t_s = max(t_a, t_e, t_c)
    return max(r + (m * layers - 1) * t_s, layers * r + (m - 1) * t_s)


def comm_hidden(t_a: float, t_e: float, t_c: float, m: int) -> bool:
    """True when the pipeline stays full: m * T_f >= R and the links are not the bottleneck."""
    t_f = max(t_a, t_e)
    return t_c <= t_f and m * t_f >= t_a + t_e + 2 * t_c


def m_min(t_c: float, t_f: float) -> float:
    """Fewest micro-batches that hide communication: m >= 2 (1 + T_c / T_f)."""
    if t_f <= 0:
        raise ConfigError(f"m_min: T_f={t_f} must be > 0")
    return 2 * (1 + t_c / t_f)


def micro_batch_sizes(batch: int, m: int, n_a: int, num_experts: int, top_k: int) -> tuple[float, float]:
    """Token conservation b_a * m * n_a = b_e * m * E / K = B: returns (b_a, b_e)."""
    if batch < 0 or m < 1 or n_a < 1:
        raise ConfigError(f"micro_batch_sizes: batch={batch}, m={m}, n_a={n_a}")
    b_a = batch / (m * n_a)
    b_e = batch * top_k / (m * num_experts)
    return b_a, b_e


def balanced_replicas(k1: float, k3: float, num_experts: int, top_k: int,
                      experts_per_rank: int = 1) -> float:
    """Algorithm 1's attention replicas, n_a = k1 E / (k3 K), from T_a = T_e (slopes only).

    With b_e = b_a n_a K / E and one expert per rank, k1 b_a = k3 b_e gives n_a = k1 E / (k3 K);
    a rank holding e experts runs e of them, so n_a shrinks by e.
    """
    if k3 <= 0:
        raise ConfigError(f"balanced_replicas: k3={k3} must be > 0")
    return k1 * num_experts / (k3 * top_k * experts_per_rank)
