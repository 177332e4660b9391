"""Draw a pipeline trace (docs/trace_format.md; runtime or simulator) as lanes over time per rank.

  python perf/plot_timeline.py trace.json -o timeline.png [--layers 3] [--ranks 4] [--iter 0]
"""
from __future__ import annotations

import argparse

from megainfer.perfmodel.timeline_plot import plot_trace
from megainfer.perfmodel.trace import read_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("-o", "--out", default="timeline.png")
    ap.add_argument("--layers", type=int, default=None, help="draw layers < N only")
    ap.add_argument("--ranks", type=int, default=4, help="first N attention and N expert ranks")
    ap.add_argument("--iter", type=int, default=None, help="one iteration only")
    a = ap.parse_args()
    n = plot_trace(read_trace(a.trace), a.out, max_layer=a.layers, max_ranks=a.ranks, iteration=a.iter)
    print(f"drew {n} events -> {a.out}")


if __name__ == "__main__":
    main()
