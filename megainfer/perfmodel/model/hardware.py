"""Hardware profiles: what one accelerator (or one CPU rank) can do, read from YAML.

A profile is the roofline of one device (matmul FLOP/s per dtype, memory bandwidth and
capacity), its links (intra-node for TP, inter-node for A2E/E2A), a price, and, when a
calibration run measured this machine, linear fits of the per-layer times for named models.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

import yaml

from megainfer.config import ConfigError


class UnknownHardwareError(ConfigError):
    """A hardware name that has no profile under conf/hardware/."""


def _positive(name: str, v) -> None:
    if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
        raise ConfigError(f"{name}={v!r}: must be a positive number")


@dataclass(frozen=True)
class LinkProfile:
    """One link: t(n bytes) = latency + n / (bandwidth * util(message size)).

    ``curve`` is ((message_bytes, utilisation 0..1), ...) sorted by size; utilisation is
    interpolated in log(size) and clamped at the ends. Empty curve: utilisation 1.
    """

    latency_s: float
    bandwidth_Bps: float
    curve: tuple[tuple[float, float], ...] = ()

    def __post_init__(self):
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ConfigError(f"link.latency_s={self.latency_s!r}: must be >= 0")
        _positive("link.bandwidth_Bps", self.bandwidth_Bps)
        sizes = [s for s, _ in self.curve]
        if sizes != sorted(sizes) or any(not (0 < u <= 1.0 + 1e-9) for _, u in self.curve):
            raise ConfigError(f"link.curve={self.curve!r}: sizes must ascend, utilisation in (0, 1]")

    def utilisation(self, msg_bytes: float) -> float:
        if not self.curve or msg_bytes <= 0:
            return 1.0
        pts = self.curve
        if msg_bytes <= pts[0][0]:
            return pts[0][1]
        if msg_bytes >= pts[-1][0]:
            return pts[-1][1]
        x = math.log(msg_bytes)
        for (s0, u0), (s1, u1) in zip(pts, pts[1:]):
            if s0 <= msg_bytes <= s1:
                w = (x - math.log(s0)) / (math.log(s1) - math.log(s0))
                return u0 + w * (u1 - u0)
        return pts[-1][1]

    def time(self, total_bytes: float, n_msgs: int = 1) -> float:
        """Seconds to move ``total_bytes`` as ``n_msgs`` concurrent messages of equal size."""
        if total_bytes <= 0:
            return self.latency_s
        per_msg = total_bytes / max(1, n_msgs)
        return self.latency_s + total_bytes / (self.bandwidth_Bps * self.utilisation(per_msg))


@dataclass(frozen=True)
class LayerFit:
    """Calibrated per-layer times on this hardware for one model shape (seconds).

    T_a(b, ctx) = k2 + b * (k1 + k1_ctx * ctx)   one attention micro-batch of b tokens
    T_e(b)      = k4 + k3 * b                    one expert with b tokens (0 tokens: 0)
    """

    k1: float
    k2: float
    k3: float
    k4: float
    k1_ctx: float = 0.0
    ctx_ref: int = 0
    dtype: str = "float32"

    def t_attn(self, b: float, ctx: float) -> float:
        return self.k2 + b * (self.k1 + self.k1_ctx * ctx) if b > 0 else 0.0

    def t_expert_one(self, b: float) -> float:
        return self.k4 + self.k3 * b if b > 0 else 0.0


@dataclass(frozen=True)
class NodeProfile:
    """What ranks placed on one node share (CPU nodes: the cores and the memory system).

    cores            cores per node; 0 means every rank owns its device (GPUs): no sharing
    contention       per-layer kernel kind ("attention", "expert") -> slowdown of that kernel's
                     CPU time when two processes run such kernels at the same time vs one alone
                     (memory bandwidth and last-level cache shared); missing kind: 1.0
    hop_overhead_s   host work per (layer, micro-batch) outside the kernels, per side:
                     "attention" (route bookkeeping, dispatch, combine, residual add) and
                     "expert" (receive, gather, split, reply): seconds = base + per_peer * peers
    wake_latency_s   mean delay between a message arriving and a rank waiting for it noticing
                     (the runtime's wait policy polls, then sleeps between polls); added to T_c
    background_load  mean runnable threads of other tenants on the node (0: the job has the
                     cores to itself); they time-share the cores with the job's busy ranks
    """

    cores: int = 0
    contention: dict = field(default_factory=dict)  # kind -> slowdown at 2 concurrent (>= 1)
    hop_overhead_s: dict = field(default_factory=dict)  # side -> {"base": s, "per_peer": s}
    wake_latency_s: float = 0.0
    background_load: float = 0.0

    def __post_init__(self):
        for key in ("wake_latency_s", "background_load"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ConfigError(f"node.{key}={v!r}: must be >= 0")
        if not (isinstance(self.cores, int) and self.cores >= 0):
            raise ConfigError(f"node.cores={self.cores!r}: must be an integer >= 0")
        for k, v in self.contention.items():
            if k not in ("attention", "expert") or not (isinstance(v, (int, float)) and 1.0 <= v < 10):
                raise ConfigError(f"node.contention.{k}={v!r}: kind must be attention|expert, "
                                  f"slowdown in [1, 10)")
        for k, v in self.hop_overhead_s.items():
            if k not in ("attention", "expert") or not isinstance(v, dict) or any(
                    n not in ("base", "per_peer") or not (x >= 0 and math.isfinite(x))
                    for n, x in v.items()):
                raise ConfigError(f"node.hop_overhead_s.{k}={v!r}: side must be attention|expert "
                                  f"with base / per_peer seconds >= 0")

    @property
    def shared(self) -> bool:
        return self.cores > 0

    def hop_overhead(self, side: str, peers: int) -> float:
        """Host seconds per (layer, micro-batch) on ``side`` talking to ``peers`` ranks."""
        h = self.hop_overhead_s.get(side, {})
        return h.get("base", 0.0) + h.get("per_peer", 0.0) * peers

    def dilation(self, kind: str, busy: float) -> float:
        """Wall / alone-CPU time of a ``kind`` kernel while ``busy`` ranks (itself included)
        compute on this node: cores split evenly over the busy ranks and ``background_load``
        other tenants' threads when they outnumber the cores (OS time sharing), and each extra
        process of the job computing on another core at the same time adds (contention - 1)."""
        if not self.shared or busy + self.background_load <= 1:
            return 1.0
        running = min(max(busy, 1.0), self.cores)
        share = max(1.0, (max(busy, 1.0) + self.background_load) / self.cores)
        return share * (1.0 + (self.contention.get(kind, 1.0) - 1.0) * (running - 1))


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    matmul_flops: dict  # dtype -> peak dense FLOP/s
    mem_bw_Bps: float
    mem_bytes: float
    intra_link: LinkProfile  # TP collectives inside a node (NVLink, shared memory)
    inter_link: LinkProfile  # A2E / E2A between ranks (NIC, MPI)
    price_per_hour: float
    matmul_efficiency: float = 0.7  # achieved / peak, applied to roofline times
    mem_efficiency: float = 0.8
    kernel_overhead_s: float = 0.0  # fixed cost per layer-module call (launches, python)
    mem_util: float = 0.9  # fraction of mem_bytes usable for weights + KV
    fits: dict = field(default_factory=dict)  # model name -> LayerFit
    source: str = ""
    node: NodeProfile = field(default_factory=NodeProfile)  # default: one device per rank

    def __post_init__(self):
        if not self.matmul_flops:
            raise ConfigError(f"hardware[{self.name}].matmul_flops: empty")
        for dt, v in self.matmul_flops.items():
            _positive(f"hardware[{self.name}].matmul_flops.{dt}", v)
        for n in ("mem_bw_Bps", "mem_bytes", "matmul_efficiency", "mem_efficiency", "mem_util"):
            _positive(f"hardware[{self.name}].{n}", getattr(self, n))
        if self.price_per_hour < 0:
            raise ConfigError(f"hardware[{self.name}].price_per_hour={self.price_per_hour!r}: must be >= 0")

    def flops(self, dtype: str) -> float:
        if dtype not in self.matmul_flops:
            raise ConfigError(f"hardware[{self.name}] has no matmul_flops for dtype={dtype!r}; "
                              f"it has {sorted(self.matmul_flops)}")
        return self.matmul_flops[dtype]


def _link(d: dict, where: str) -> LinkProfile:
    if not isinstance(d, dict) or "bandwidth_Bps" not in d:
        raise ConfigError(f"{where}: needs bandwidth_Bps (and latency_s)")
    curve = tuple((float(s), float(u)) for s, u in d.get("curve", ()) or ())
    return LinkProfile(float(d.get("latency_s", 0.0)), float(d["bandwidth_Bps"]), curve)


def profile_from_dict(d: dict, name: str = "") -> HardwareProfile:
    name = d.get("name", name)
    need = ("matmul_flops", "mem_bw_Bps", "mem_bytes", "inter_link", "price_per_hour")
    for k in need:
        if k not in d:
            raise ConfigError(f"hardware[{name}].{k}: missing")
    fits = {m: LayerFit(**{k: v for k, v in f.items() if k in LayerFit.__dataclass_fields__})
            for m, f in (d.get("fits") or {}).items()}
    inter = _link(d["inter_link"], f"hardware[{name}].inter_link")
    intra = _link(d.get("intra_link", d["inter_link"]), f"hardware[{name}].intra_link")
    opt = {k: float(d[k]) for k in ("matmul_efficiency", "mem_efficiency", "kernel_overhead_s",
                                    "mem_util") if k in d}
    return HardwareProfile(name=name, matmul_flops={k: float(v) for k, v in d["matmul_flops"].items()},
                           mem_bw_Bps=float(d["mem_bw_Bps"]), mem_bytes=float(d["mem_bytes"]),
                           intra_link=intra, inter_link=inter,
                           price_per_hour=float(d["price_per_hour"]), fits=fits,
                           source=str(d.get("source", "")), node=_node(d.get("node"), name), **opt)


def _node(d, name: str) -> NodeProfile:
    if d is None:
        return NodeProfile()
    if not isinstance(d, dict):
        raise ConfigError(f"hardware[{name}].node={d!r}: must be a mapping (cores, contention, hop_overhead_s)")
    unknown = set(d) - {"cores", "contention", "hop_overhead_s", "wake_latency_s", "background_load"}
    if unknown:
        raise ConfigError(f"hardware[{name}].node: unknown keys {sorted(unknown)}")
    return NodeProfile(cores=d.get("cores", 0), contention={k: float(v) for k, v in (d.get("contention") or {}).items()},
                       hop_overhead_s={k: {n: float(x) for n, x in (v or {}).items()} if isinstance(v, dict) else v
                                       for k, v in (d.get("hop_overhead_s") or {}).items()},
                       wake_latency_s=float(d.get("wake_latency_s", 0.0)),
                       background_load=float(d.get("background_load", 0.0)))


def with_background_load(hw: HardwareProfile, load: float) -> HardwareProfile:
    """``hw`` with ``node.background_load`` = ``load`` (e.g. the node's run-queue length less
    the job's own ranks, read where the job starts); GPU profiles (no shared cores) unchanged."""
    if not hw.node.shared:
        return hw
    return replace(hw, node=replace(hw.node, background_load=max(0.0, float(load))))


def hardware_dir() -> str:
    import megainfer.conf
    return os.path.join(os.path.dirname(megainfer.conf.__file__), "hardware")


def known_hardware() -> list[str]:
    d = hardware_dir()
    return sorted(f[:-5] for f in os.listdir(d) if f.endswith(".yaml")) if os.path.isdir(d) else []


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A preset name under conf/hardware/ (``h100``) or a path to a YAML profile."""
    path = name_or_path if name_or_path.endswith(".yaml") else os.path.join(
        hardware_dir(), f"{name_or_path}.yaml")
    if not os.path.isfile(path):
        raise UnknownHardwareError(f"hardware={name_or_path!r}: no such profile; known: "
                                   f"{', '.join(known_hardware())} (or give a path to a .yaml)")
    with open(path) as f:
        d = yaml.safe_load(f) or {}
    d.pop("defaults", None)
    return profile_from_dict(d, os.path.basename(path)[:-5])
