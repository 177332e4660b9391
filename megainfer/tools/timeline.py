"""``megainfer-timeline``: draw one iteration of a pipeline trace (docs/trace_format.md).

    megainfer-timeline trace.json -o timeline.png [--iter K] [--layers N] [--ranks N]

Without ``--iter`` a steady-state iteration is drawn (``steady_iteration``): a whole run is
dominated by its start-up (the first iteration's prefill and warm-up), which hides the
ping-pong. Lanes are labelled per rank, a legend names their colours, and a note under the plot
says what the send/receive lanes include. ``trace.enabled=true`` runs draw
``<run dir>/timeline.png`` this way. Plotting needs matplotlib: ``pip install 'megainfer[plot]'``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict

PLOT_EXTRA = "pip install 'megainfer[plot]'"
# what a send/receive span covers, by mode (runtime/exchange.py, runtime/expert_worker.py)
LANE_NOTES = {
    "disaggregated": (
        "A2E on an attention rank: splitting the micro-batch per expert rank and posting the sends. "
        "E2A on an attention rank: blocked until every expert rank's partial sums arrived, and their "
        "sum\n(so it holds both transfers and any expert compute still running). A2E on an expert "
        "rank: blocked until the tokens arrived. E2A on an expert rank: posting the reply."),
    "colocated": (
        "dispatch: splitting the micro-batch per rank and posting the all-to-all sends. combine: "
        "blocked until every rank's partial sums arrived, and their sum\n(so it holds both transfers "
        "and any expert compute of the other ranks still running)."),
}


class PlotExtraMissing(ImportError):
    """matplotlib is not installed; the message names the extra to install."""


def steady_iteration(trace: dict) -> int:
    """The iteration to draw: of those after the first quarter (at least the first one, its
    prefill and warm-up, is skipped), the one whose span across all ranks is the median."""
    spans = defaultdict(lambda: [float("inf"), float("-inf")])
    for e in trace["events"]:
        s = spans[e.get("args", {}).get("iter", 0)]
        s[0], s[1] = min(s[0], e["ts"]), max(s[1], e["ts"] + e["dur"])
    if not spans:
        raise ValueError("steady_iteration: the trace has no events")
    its = sorted(spans)
    rest = its[max(1, len(its) // 4):] or its
    dur = {i: spans[i][1] - spans[i][0] for i in rest}
    med = statistics.median_low(sorted(dur.values()))
    return min(i for i in rest if dur[i] == med)


def draw_timeline(trace_path: str, out_png: str, iteration: int | None = None,
                  layers: int | None = None, ranks: int = 4) -> tuple[int, int]:
    """Draw ``trace_path`` into ``out_png``; (the iteration drawn, events drawn).
    ``PlotExtraMissing`` without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise PlotExtraMissing(f"drawing a timeline needs matplotlib: {PLOT_EXTRA}") from e
    from megainfer.perfmodel.timeline_plot import plot_trace
    from megainfer.perfmodel.trace import read_trace
    trace = read_trace(trace_path)
    it = steady_iteration(trace) if iteration is None else iteration
    mode = trace.get("metadata", {}).get("mode", "disaggregated")
    src = trace.get("metadata", {}).get("source", "trace")
    n = plot_trace(trace, out_png, max_layer=layers, max_ranks=ranks, iteration=it,
                   title=f"pipeline timeline, iteration {it} ({src}, {mode})",
                   notes=LANE_NOTES.get(mode, ""))
    return it, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="megainfer-timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a trace.json of a run (trace.enabled=true) or of megainfer-plan")
    ap.add_argument("-o", "--out", default="timeline.png")
    ap.add_argument("--iter", type=int, default=None,
                    help="the iteration to draw (default: a steady-state one)")
    ap.add_argument("--layers", type=int, default=None, help="draw layers < N only")
    ap.add_argument("--ranks", type=int, default=4, help="first N attention and N expert ranks")
    a = ap.parse_args(argv)
    try:
        it, n = draw_timeline(a.trace, a.out, a.iter, a.layers, a.ranks)
    except (PlotExtraMissing, ValueError, OSError) as e:
        print(f"megainfer-timeline: error: {e}", file=sys.stderr)
        return 2
    print(f"drew {n} events of iteration {it} -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
