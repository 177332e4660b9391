"""``perf/bench/bench_m2n.py``'s targets, read off its rows: each M2N variant's p50 / p99 against
MPI_Alltoallv and gloo per (M x N, direction, size), the A/A noise envelope (Alltoallv rated
against itself: a cell counts as lost only beyond the worst ratio between identical methods),
the flat-poll ablation, ping-pong against raw MPI and the compute lost to traffic in flight."""
from __future__ import annotations


def human(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


VARIANTS = ("m2n", "m2n-yield", "m2n-spin")  # wait policy: backoff (default), yield, spin
# rated against Alltoallv and gloo: mpi-p2p is the floor of a Python p2p layer, and
# alltoallv-again the A/A control (Alltoallv itself, interleaved as a separate method)
COMPARED = VARIANTS + ("mpi-p2p", "alltoallv-again", "m2n-flatpoll")
# m2n-flatpoll: the default channel with a receive's first 32 polls flat out (no sched_yield),
# as it was before 2026-11-29; m2n / m2n-flatpoll per cell is that change, measured in one run


def check_targets(res) -> dict:
    key = {(r["M"], r["N"], r["direction"], r["size"], r["method"]): r for r in res["collectives"]}
    out = {}
    for v in COMPARED if res["collectives"] else ():
        ratios = []
        for (M, N, d, size, meth), r in key.items():
            if meth != v:
                continue
            a, g = key[(M, N, d, size, "alltoallv")], key[(M, N, d, size, "gloo")]
            ratios.append(dict(cfg=f"{M}x{N} {d} {human(size)}", vs_a2av_p50=r["p50"] / a["p50"],
                               vs_a2av_p99=r["p99"] / a["p99"], vs_gloo_p50=r["p50"] / g["p50"]))
        if not ratios:  # a method this run did not measure (m2n-spin where ranks > cores)
            continue
        out[v] = dict(
            ratios=ratios,
            p50_le_alltoallv=f"{sum(x['vs_a2av_p50'] <= 1 for x in ratios)}/{len(ratios)}",
            p99_le_alltoallv=f"{sum(x['vs_a2av_p99'] <= 1 for x in ratios)}/{len(ratios)}",
            median_p50_ratio_vs_alltoallv=sorted(x["vs_a2av_p50"] for x in ratios)[len(ratios) // 2],
            p50_below_gloo=f"{sum(x['vs_gloo_p50'] < 1 for x in ratios)}/{len(ratios)}")
    aa = out.get("alltoallv-again")
    if aa:  # the noise envelope: the worst ratio between identical methods
        env50 = max(x["vs_a2av_p50"] for x in aa["ratios"])
        env99 = max(x["vs_a2av_p99"] for x in aa["ratios"])
        out["aa_noise_envelope"] = dict(p50=env50, p99=env99)
        for v in (v for v in COMPARED if v in out):  # cells lost by more than Alltoallv ever
            # lost to itself in this run
            out[v]["p50_beyond_aa_noise"] = [x["cfg"] for x in out[v]["ratios"]
                                             if x["vs_a2av_p50"] > env50]
            out[v]["p99_beyond_aa_noise"] = [x["cfg"] for x in out[v]["ratios"]
                                             if x["vs_a2av_p99"] > env99]
    if out.get("m2n-flatpoll"):
        by_cfg = {}
        for (M, N, d, size, meth), r in key.items():
            if meth == "m2n":
                flat = key[(M, N, d, size, "m2n-flatpoll")]
                by_cfg.setdefault(f"{M}x{N}", []).append(r["p50"] / flat["p50"])
        out["m2n_vs_flatpoll_p50"] = {  # < 1: yielding first polls are faster
            cfg: dict(median=sorted(v)[len(v) // 2], min=min(v), max=max(v))
            for cfg, v in by_cfg.items()}
    if "pingpong" in res:
        pp = {(r["method"], r["size"]): r for r in res["pingpong"]}
        sizes = sorted({s for _, s in pp})
        out["pingpong_latency_ratio_vs_raw_small"] = {
            v: {s: pp[(v, s)]["p50"] / pp[("mpi-raw", s)]["p50"] for s in sizes[:2]}
            for v in VARIANTS}
        out["pingpong_bandwidth_fraction_of_raw_large"] = {
            v: {s: pp[("mpi-raw", s)]["p50"] / pp[(v, s)]["p50"] for s in sizes[-2:]}
            for v in VARIANTS}
    if "overlap" not in res:
        return out
    out["compute_loss_with_traffic"] = {  # compute time with dispatch in flight / alone - 1
        f"{k}/{mode}": res[k][mode]["compute"] / res[k]["alone"]["compute"] - 1
        for k in ("overlap", "overlap_1x2") for mode in ("m2n", "m2n-noprogress", "alltoallv")}
    return out
