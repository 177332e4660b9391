"""Routed-token counts per (layer, logical expert) over a sliding window of iterations.

The counter is a ring buffer [W, layers, experts] of finished iterations plus one
accumulator for the iteration in progress. ``record`` is one ``index_add_`` on the
device the ids live on (no host sync, unlike ``bincount`` on CUDA), so an expert rank can
count the tokens it receives without touching the critical path; ``load()`` (the sum
over the window) is what the rebalancer reads, after an all-reduce over expert ranks.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from megainfer.eplb.placement_policy import EplbError


class StatsError(EplbError):
    """Bad input to the load counter; the message names the argument."""


def _require(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise StatsError(f"{name}={value!r}: {why}")


class ExpertLoadWindow:
    """Tokens routed to each logical expert, per layer, over the last ``window`` iterations."""

    def __init__(self, num_layers: int, num_experts: int, window: int, device="cpu"):
        for name, v in (("num_layers", num_layers), ("num_experts", num_experts), ("window", window)):
            _require(isinstance(v, int) and v >= 1, name, v, "must be an integer >= 1")
        self.num_layers, self.num_experts, self.window = num_layers, num_experts, window
        self.ring = torch.zeros(window, num_layers, num_experts, dtype=torch.int64, device=device)
        self.current = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.head = 0          # ring row the next finished iteration goes to
        self.iterations = 0    # finished iterations since creation (or the last reset)

    # -- counting ------------------------------------------------------------------------
    def record(self, layer: int, topk_ids: torch.Tensor,
               weights: Optional[torch.Tensor] = None) -> None:
        """Count one layer's routing decisions: topk_ids [M, k] logical expert ids, each counted
        once or ``weights`` (same numel, int; e.g. 0/1 for "served here") times."""
        _require(0 <= layer < self.num_layers, "layer", layer, f"must be in [0, {self.num_layers})")
        ids = topk_ids.reshape(-1).long()                                # [M*k]
        if ids.numel() == 0:
            return
        if ids.device.type == "cpu":  # on GPU an out-of-range id trips a device assert instead
            _require(int(ids.min()) >= 0 and int(ids.max()) < self.num_experts, "topk_ids",
                     (int(ids.min()), int(ids.max())), f"ids must be in [0, {self.num_experts})")
        ids = ids.to(self.current.device)
        w = torch.ones_like(ids) if weights is None else weights.reshape(-1).to(ids.device, torch.int64)
        self.current[layer].index_add_(0, ids, w)

    def record_physical(self, layer: int, slot_ids: torch.Tensor, phy2log: torch.Tensor) -> None:
        """Count tokens that arrived for physical slots: slot_ids [n], phy2log [L, R] or [R]."""
        table = phy2log[layer] if phy2log.dim() == 2 else phy2log                  # [R]
        self.record(layer, table.to(slot_ids.device)[slot_ids.reshape(-1).long()])

    def record_counts(self, layer: int, counts: torch.Tensor) -> None:
        """Add already-counted tokens per expert: counts [N]."""
        _require(0 <= layer < self.num_layers, "layer", layer, f"must be in [0, {self.num_layers})")
        _require(tuple(counts.shape) == (self.num_experts,), "counts.shape", tuple(counts.shape),
                 f"must be ({self.num_experts},)")
        self.current[layer] += counts.to(self.current.device, torch.int64)

    def end_iteration(self) -> None:
        """Close the iteration in progress: it enters the window, the oldest one leaves."""
        self.ring[self.head].copy_(self.current)
        self.current.zero_()
        self.head = (self.head + 1) % self.window
        self.iterations += 1

    def reset(self) -> None:
        self.ring.zero_()
        self.current.zero_()
        self.head, self.iterations = 0, 0

    # -- reading -------------------------------------------------------------------------
    @property
    def filled(self) -> int:
        """How many finished iterations the window holds (<= window)."""
        return min(self.iterations, self.window)

    def load(self) -> torch.Tensor:
        """Tokens per (layer, expert) summed over the window: [L, N] int64."""
        return self.ring.sum(0)

    def history(self) -> torch.Tensor:
        """The window's iterations, oldest first: [filled, L, N]."""
        order = [(self.head - self.filled + i) % self.window for i in range(self.filled)]
        return self.ring[order]

    def to_dict(self, with_history: bool = False) -> dict:
        out = {"num_layers": self.num_layers, "num_experts": self.num_experts,
               "window": self.window, "iterations": self.iterations, "filled": self.filled,
               "load": self.load().cpu().tolist()}
        if with_history:
            out["history"] = self.history().cpu().tolist()
        return out

    def save_json(self, path: str, with_history: bool = False) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(with_history), f)

    @classmethod
    def from_dict(cls, d: dict) -> "ExpertLoadWindow":
        """Rebuild from ``to_dict`` output; needs the history to refill the ring."""
        _require("history" in d, "history", None, "to_dict(with_history=True) output is needed")
        win = cls(int(d["num_layers"]), int(d["num_experts"]), int(d["window"]))
        for it in d["history"]:
            win.current.copy_(torch.tensor(it, dtype=torch.int64))
            win.end_iteration()
        win.iterations = int(d["iterations"])
        return win

    def save_heatmap(self, path: str, title: Optional[str] = None) -> None:
        save_heatmap(self.load(), path, title or f"expert load, last {self.filled} iterations")


def save_heatmap(load: torch.Tensor, path: str, title: str = "expert load", log: bool = True) -> None:
    """PNG heat map of load [L, N]: one row per layer, each cell the expert's tokens over
    the layer's mean tokens per expert (1.0 = average expert); log colour scale by default."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    x = load.detach().cpu().double()                                     # [L, N]
    L, N = x.shape
    rel = x / x.mean(-1, keepdim=True).clamp(min=1e-12)                  # [L, N]
    fig = Figure(figsize=(min(2 + N / 8, 24), min(1.5 + L / 4, 16)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    norm = None
    if log and bool((rel > 0).any()):  # hot experts would wash out a linear scale
        from matplotlib.colors import LogNorm
        lo = max(float(rel[rel > 0].min()), 1e-2)
        norm = LogNorm(vmin=lo, vmax=max(float(rel.max()), lo * 1.01))
        rel = rel.clamp(min=lo)
    im = ax.imshow(rel.numpy(), aspect="auto", cmap="viridis", interpolation="nearest", norm=norm)
    ax.set_xlabel("logical expert")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="tokens / mean tokens per expert")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
