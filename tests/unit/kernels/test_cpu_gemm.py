"""kernels/cpu_gemm: the private oneDNN ops it relies on, each method against F.linear, the
rule table, and repacking after weights change."""
import pytest
import torch
import torch.nn.functional as F

from megainfer.kernels import cpu_gemm


def test_private_onednn_ops_keep_their_schema():
    """cpu_gemm calls two private ops (the pair torch.compile's CPU backend emits for frozen
    linear weights): a torch that changes or drops them must fail here, loudly."""
    assert torch.backends.mkldnn.is_available()
    reorder = str(torch.ops.mkldnn._reorder_linear_weight.default._schema)
    assert reorder == "mkldnn::_reorder_linear_weight(Tensor self, int? batch_size=None) -> Tensor Y"
    pointwise = str(torch.ops.mkldnn._linear_pointwise.default._schema)
    assert pointwise == ("mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, "
                         "Scalar?[] scalars, str? algorithm) -> Tensor Y")


@pytest.mark.parametrize("method", cpu_gemm.METHODS)
@pytest.mark.parametrize("rows", [0, 1, 3, 8, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_each_method_matches_f_linear(method, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 40, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    rules = {k: {"1": [[None, method]]} for k in cpu_gemm.KINDS}
    with cpu_gemm.use_rules(rules):
        assert cpu_gemm.method_for(rows) == method
        y = cpu_gemm.linear(x, w, b)
        parts = cpu_gemm.linear_split(x, [w[:16], w[16:40], w[40:]],
                                      None if b is None else [b[:16], b[16:40], b[40:]])
    ref = F.linear(x, w, b)
    assert y.shape == ref.shape and [p.shape[1] for p in parts] == [16, 24, 8]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(parts, 1), ref, rtol=1e-5, atol=1e-5)


def test_stacked_weight_index_and_leading_dims():
    w = torch.randn(3, 16, 8)
    x = torch.randn(2, 5, 8)
    for e in range(3):
        torch.testing.assert_close(cpu_gemm.linear(x, w, index=e, kind="expert"), x @ w[e].t(),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", cpu_gemm.METHODS)
def test_stacked_linear_matches_linear(method):
    """The expert loop's accessor: every index and row count (0 included) as ``linear`` with
    ``index`` computes it, a bf16 weight through F.linear, and a repack after a copy_."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 24, 16, generator=g)
    rules = {k: {"1": [[None, method]]} for k in cpu_gemm.KINDS}
    with cpu_gemm.use_rules(rules):
        run = cpu_gemm.stacked_linear(w)
        for e in range(4):
            for rows in (0, 1, 5):
                x = torch.randn(rows, 16, generator=g)
                torch.testing.assert_close(run(x, e), cpu_gemm.linear(x, w, index=e, kind="expert"))
                torch.testing.assert_close(run(x, e), x @ w[e].t(), rtol=1e-5, atol=1e-5)
        wb, xb = w.bfloat16(), torch.randn(3, 16, generator=g).bfloat16()  # not oneDNN's
        assert torch.equal(cpu_gemm.stacked_linear(wb)(xb, 1), torch.nn.functional.linear(xb, wb[1]))
        with torch.no_grad():
            w[2].copy_(torch.randn(24, 16, generator=g))
        x = torch.randn(2, 16, generator=g)
        torch.testing.assert_close(cpu_gemm.stacked_linear(w)(x, 2), x @ w[2].t(), rtol=1e-5, atol=1e-5)


def test_repacks_after_in_place_writes():
    """copy_ bumps the version counter (repacked on its own); a write through .data does not:
    forget_packed drops the stale layout."""
    rules = {k: {"1": [[None, "onednn"]]} for k in cpu_gemm.KINDS}
    w = torch.nn.Parameter(torch.randn(3, 16, 8), requires_grad=False)
    x = torch.randn(4, 8)
    with cpu_gemm.use_rules(rules):
        cpu_gemm.linear(x, w, index=1)
        with torch.no_grad():
            w[1].copy_(torch.randn(16, 8))
        torch.testing.assert_close(cpu_gemm.linear(x, w, index=1), x @ w[1].t())
        w.data[1].copy_(torch.randn(16, 8))
        cpu_gemm.forget_packed(w, 1)
        torch.testing.assert_close(cpu_gemm.linear(x, w, index=1), x @ w[1].t())


def test_other_dtypes_take_f_linear():
    w, x = torch.randn(16, 8).half(), torch.randn(4, 8).half()
    assert not cpu_gemm.onednn_ok(w)
    assert torch.equal(cpu_gemm.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_bf16_takes_onednn(rows):
    """bf16 weights and activations take oneDNN's inner product (issue 50), which accumulates
    in fp32 like F.linear: the same values up to bf16 rounding of the output."""
    w = torch.randn(48, 32).bfloat16()
    x = torch.randn(rows, 32).bfloat16()
    assert cpu_gemm.onednn_ok(w)
    with cpu_gemm.use_rules({k: {"1": [[None, "onednn"]]} for k in cpu_gemm.KINDS}):
        y = cpu_gemm.linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), (x.float() @ w.float().t()), atol=2e-2, rtol=1e-2)


def test_rules_per_thread_count():
    rules = {"expert": {"1": [[4, "skinny"], [None, "onednn"]], "4": [[None, "mm"]]},
             "dense": {"2": [[None, "mm"]]}}
    with cpu_gemm.use_rules(rules):
        assert cpu_gemm.method_for(4, "expert", threads=1) == "skinny"
        assert cpu_gemm.method_for(5, "expert", threads=3) == "onednn"
        assert cpu_gemm.method_for(1, "expert", threads=8) == "mm"
        assert cpu_gemm.method_for(1, "dense", threads=1) == "mm"  # below every key: the smallest
    assert cpu_gemm.method_for(8, "expert") in cpu_gemm.METHODS  # the measured table is back


def test_measured_table_is_valid():
    import json
    with open(cpu_gemm.RULES_PATH) as f:
        table = json.load(f)
    assert table["source"] == "perf/bench/tune_cpu_gemm.py"
    cpu_gemm.check_rules(table["rules"])


@pytest.mark.parametrize("rules,culprit", [
    ({"expert": {"1": [[None, "mm"]]}}, "kinds"),
    ({"expert": {"0": [[None, "mm"]]}, "dense": {"1": [[None, "mm"]]}}, "thread key"),
    ({"expert": {"1": [[None, "blas"]]}, "dense": {"1": [[None, "mm"]]}}, "'blas'"),
    ({"expert": {"1": [[8, "mm"], [4, "mm"], [None, "mm"]]}, "dense": {"1": [[None, "mm"]]}},
     "not ascending"),
    ({"expert": {"1": [[8, "mm"]]}, "dense": {"1": [[None, "mm"]]}}, "last entry"),
])
def test_bad_rules_name_the_entry(rules, culprit):
    with pytest.raises(cpu_gemm.CpuGemmRuleError, match=culprit):
        cpu_gemm.check_rules(rules)


def test_tuner_writes_no_multithread_rule_from_busy_cores(tmp_path, monkeypatch):
    """perf/bench/tune_cpu_gemm.py: a thread count > 1 timed while the load average left fewer
    free cores than threads gets no rule (method_for falls back to the 1-thread one)."""
    import json
    import os

    from repo_paths import PERF
    monkeypatch.syspath_prepend(os.path.join(PERF, "bench"))
    monkeypatch.syspath_prepend(os.path.join(PERF, "harness"))
    import tune_cpu_gemm
    out = tmp_path / "tune.json"
    args = ["--threads", "1", "2", "--repeats", "1", "--hidden", "32", "--inter", "32",
            "--experts", "2", "--vocab", "64", "--flush-mb", "1", "--dtypes", "float32",
            "--no-write", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        monkeypatch.setattr(tune_cpu_gemm.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
        monkeypatch.setattr(tune_cpu_gemm.os, "cpu_count", lambda: 2)
        tune_cpu_gemm.main(args)
        busy = json.loads(out.read_text())
        monkeypatch.setattr(tune_cpu_gemm.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        tune_cpu_gemm.main(args)
        quiet = json.loads(out.read_text())
    finally:
        torch.set_num_threads(threads)
    assert all(sorted(busy["rules"][k]) == ["1"] for k in cpu_gemm.KINDS)
    assert sorted((r["kind"], r["threads"]) for r in busy["not_written"]) == \
        [("dense", 2), ("expert", 2)]
    assert all(sorted(quiet["rules"][k]) == ["1", "2"] for k in cpu_gemm.KINDS)
    args[args.index("float32")] = "bfloat16"  # bf16 writes its own kinds
    tune_cpu_gemm.main(args)
    assert sorted(json.loads(out.read_text())["rules"]) == sorted(cpu_gemm.BF16_KINDS)


def test_bf16_rules_are_their_own_else_fp32s():
    """A table without bf16 kinds applies fp32's to bf16; with them, bf16 looks up its own;
    an unknown kind is refused naming it."""
    fp32 = {"expert": {"1": [[2, "mm"], [None, "onednn"]]}, "dense": {"1": [[None, "mm"]]}}
    with cpu_gemm.use_rules(fp32):
        assert cpu_gemm.method_for(1, "expert", 1, torch.bfloat16) == "mm"
        assert cpu_gemm.method_for(1, "dense", 1, torch.bfloat16) == "mm"
    own = dict(fp32, **{"expert.bfloat16": {"1": [[None, "onednn"]]}})
    with cpu_gemm.use_rules(own):
        assert cpu_gemm.method_for(1, "expert", 1, torch.bfloat16) == "onednn"
        assert cpu_gemm.method_for(1, "expert", 1, torch.float32) == "mm"
        assert cpu_gemm.method_for(1, "dense", 1, torch.bfloat16) == "mm"  # fp32's
    with pytest.raises(cpu_gemm.CpuGemmRuleError, match="kinds"):
        cpu_gemm.check_rules(dict(fp32, **{"expert.float16": {"1": [[None, "mm"]]}}))
