"""Draw a pipeline trace (docs/trace_format.md) as lanes over time per rank (matplotlib)."""
from __future__ import annotations

from megainfer.perfmodel.trace import A2E, ATTENTION, COMBINE, DISPATCH, E2A, EXPERT, LANES

_COLORS = {ATTENTION: "#4C72B0", A2E: "#DD8452", EXPERT: "#C44E52", E2A: "#55A868",
           DISPATCH: "#DD8452", COMBINE: "#55A868"}


def plot_trace(trace: dict, out_png: str, max_layer: int | None = None, max_ranks: int = 4,
               iteration: int | None = None, title: str = "", notes: str = "") -> int:
    """trace = read_trace(...) output. Returns the number of events drawn.

    One row per (rank, lane) with events; blocks labelled "<mb>_<layer>" like the paper's figure.
    max_layer: draw layers < max_layer only; max_ranks: first ranks of each role only.
    A legend names each lane's colour; ``notes`` (e.g. what the send/receive lanes include)
    is printed under the plot.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evs = [e for e in trace["events"]
           if (max_layer is None or e.get("args", {}).get("layer", 0) < max_layer)
           and (iteration is None or e.get("args", {}).get("iter", 0) == iteration)]
    names = trace.get("names", {})
    attn = sorted({e["pid"] for e in evs if e["cat"] in (ATTENTION, A2E, DISPATCH)})
    expt = sorted({e["pid"] for e in evs if e["cat"] in (EXPERT, E2A, COMBINE)} - set(attn))
    pids = attn[:max_ranks] + [p for p in expt if p not in attn][:max_ranks]
    mode = trace.get("metadata", {}).get("mode", "disaggregated")
    lanes = LANES.get(mode, LANES["disaggregated"])
    rows = [(p, t) for p in pids for t in range(len(lanes))
            if any(e["pid"] == p and e["tid"] == t for e in evs)]
    row_of = {r: i for i, r in enumerate(rows)}
    if not rows:
        raise ValueError("plot_trace: no events to draw (check max_layer / iteration)")
    t0 = min(e["ts"] for e in evs if (e["pid"], e["tid"]) in row_of)
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.5))
    drawn, span = 0, 0.0
    for e in evs:
        r = row_of.get((e["pid"], e["tid"]))
        if r is None:
            continue
        x, w = (e["ts"] - t0) / 1e3, e["dur"] / 1e3  # ms
        span = max(span, x + w)
        ax.broken_barh([(x, w)], (r - 0.4, 0.8), facecolors=_COLORS.get(e["cat"], "gray"),
                       edgecolors="black", linewidth=0.3)
        a = e.get("args", {})
        ax.text(x + w / 2, r, f"{a.get('mb', '')}_{a.get('layer', '')}", ha="center", va="center",
                fontsize=6, clip_on=True)
        drawn += 1
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{names.get(p, f'rank {p}')} {lanes[t]}" for p, t in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time (ms)   block label: micro-batch_layer")
    src = trace.get("metadata", {}).get("source", "")
    ax.set_title(title or f"pipeline timeline ({src}, {mode})", fontsize=9)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(facecolor=_COLORS.get(lane, "gray"), edgecolor="black", label=lane)
                       for lane in lanes], loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              ncol=len(lanes), frameon=False)
    if notes:
        fig.text(0.01, 0.01, notes, fontsize=7, va="bottom", ha="left", wrap=True)
        fig.set_figheight(fig.get_figheight() + 0.16 * (notes.count("\n") + 1))
        fig.tight_layout(rect=(0, 0.16 * (notes.count("\n") + 1) / fig.get_figheight(), 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return drawn
