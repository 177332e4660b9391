"""The grouped-GEMM expert path (kernels/torch_moe.py ``grouped_mm_moe``: two
``torch._grouped_mm`` calls per layer) against the per-expert path (``grouped_moe``) and the
float reference, over token counts, experts, top-k, dtypes, experts without tokens and
expert-parallel slices; and the measured rule choosing between them (kernels/cpu_moe_rules.py)."""
import pytest
import torch

from megainfer.kernels import cpu_moe_rules as rules
from megainfer.kernels import fused_moe_ref
from megainfer.kernels.torch_moe import (fused_moe_torch, grouped_mm_moe, grouped_mm_ok,
                                         grouped_moe)
from megainfer.kernels.weight_quant import QuantizedWeight, WeightFormat, quantize

N, K = 48, 64
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def make_moe(M, E, k, dtype, E_global=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, K, generator=g).to(dtype)
    w1 = (torch.randn(E, 2 * N, K, generator=g) / K ** 0.5).to(dtype)
    w2 = (torch.randn(E, K, N, generator=g) / N ** 0.5).to(dtype)
    logits = torch.randn(M, E_global or E, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return hidden, w1, w2, weights.to(dtype), ids


def local_half(E_global):
    """Expert parallelism: the odd experts live here (local ids 0..), the even ones elsewhere."""
    emap = torch.full((E_global,), -1, dtype=torch.int32)
    emap[1::2] = torch.arange(E_global // 2, dtype=torch.int32)
    return emap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [1, 7, 64])
@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("ep", [False, True], ids=["all_local", "ep_slice"])
def test_grouped_mm_matches_per_expert(dtype, M, E, k, ep):
    if ep:
        hidden, w1, w2, tw, ids = make_moe(M, E // 2, k, dtype, E_global=E, seed=M * E + k)
        emap = local_half(E)
    else:
        hidden, w1, w2, tw, ids = make_moe(M, E, k, dtype, seed=M * E + k)
        emap = None
    got = grouped_mm_moe(hidden, w1, w2, tw, ids, emap)
    per_expert = grouped_moe(hidden, w1, w2, tw, ids, emap)
    assert got.shape == (M, K) and got.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), per_expert.float(), rtol=tol, atol=tol)
    ref = fused_moe_ref(hidden, w1, w2, tw, ids, emap)
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    if ep:  # tokens routed only to experts elsewhere get exactly zero
        dead = (emap[ids].long() < 0).all(dim=1)
        assert torch.equal(got[dead], torch.zeros_like(got[dead]))
    # the dispatcher takes each path as its rule says
    with rules.use_rules(rules.forced("grouped_mm")):
        assert torch.equal(fused_moe_torch(hidden, w1, w2, tw, ids, emap), got)
    with rules.use_rules(rules.forced("per_expert")):
        torch.testing.assert_close(fused_moe_torch(hidden, w1, w2, tw, ids, emap), per_expert,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("used", [(1, 2), (0, 5), (7, 3), (4,)], ids=str)
def test_experts_without_tokens(dtype, used):
    """Only the experts in ``used`` get slots: empty groups first, between and last."""
    E, M = 8, 9
    hidden, w1, w2, _, _ = make_moe(M, E, 2, dtype, seed=3)
    g = torch.Generator().manual_seed(len(used))
    k = min(2, len(used))
    pick = torch.stack([torch.randperm(len(used), generator=g)[:k] for _ in range(M)])
    ids = torch.tensor(used)[pick]  # [M, k], distinct per row
    tw = torch.rand(M, k, generator=g).to(dtype)
    got = grouped_mm_moe(hidden, w1, w2, tw, ids)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), grouped_moe(hidden, w1, w2, tw, ids, None).float(),
                               rtol=tol, atol=tol)
    torch.testing.assert_close(got.float(), fused_moe_ref(hidden, w1, w2, tw, ids).float(),
                               rtol=tol, atol=tol)


def test_every_expert_elsewhere_reads_zero():
    hidden, w1, w2, tw, ids = make_moe(5, 2, 2, torch.float32, E_global=4)
    emap = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    ids = torch.tensor([[0, 1]] * 5)
    assert torch.equal(grouped_mm_moe(hidden, w1, w2, tw, ids, emap), torch.zeros(5, K))


def test_any_weight_strides():
    """Weights stored K-major (another layout of the same values) give the same result."""
    hidden, w1, w2, tw, ids = make_moe(16, 4, 2, torch.float32)
    w1t = w1.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2N, K] view, strides differ
    w2t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(grouped_mm_moe(hidden, w1t, w2t, tw, ids),
                               grouped_mm_moe(hidden, w1, w2, tw, ids), rtol=1e-6, atol=1e-6)


def test_stored_formats_keep_the_per_expert_path():
    hidden, w1, w2, tw, ids = make_moe(8, 4, 2, torch.bfloat16)
    f = WeightFormat("int8")
    q1 = QuantizedWeight(*quantize(w1.float(), f, torch.bfloat16), f, tuple(w1.shape))
    q2 = QuantizedWeight(*quantize(w2.float(), f, torch.bfloat16), f, tuple(w2.shape))
    assert not grouped_mm_ok(hidden, q1, q2) and grouped_mm_ok(hidden, w1, w2)
    assert not grouped_mm_ok(hidden.float(), w1, w2)  # activations in another dtype
    with rules.use_rules(rules.forced("grouped_mm")):
        got = fused_moe_torch(hidden, q1, q2, tw, ids)
    assert torch.equal(got, grouped_moe(hidden, q1, q2, tw, ids, None))


TABLE = {"float32": {"1": [[8, "grouped_mm"], [None, "per_expert"]],
                     "2": [[None, "per_expert"]]}}


def test_rule_picks_its_table():
    with rules.use_rules(TABLE):
        assert [rules.method_for(torch.float32, r, 1) for r in (1, 8, 9, 128)] == [
            "grouped_mm", "grouped_mm", "per_expert", "per_expert"]
        assert rules.method_for(torch.float32, 1, 2) == "per_expert"
        assert rules.method_for(torch.float32, 1, 16) == "per_expert"  # largest key <= 16
        assert rules.method_for(torch.bfloat16, 1, 1) == "per_expert"  # DEFAULT
    with rules.use_rules({"bfloat16": {"2": [[None, "grouped_mm"]]}}):
        assert rules.method_for(torch.bfloat16, 64, 1) == "grouped_mm"  # smallest key


def test_measured_table_loads():
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 8, 64, 4096):
            for threads in (1, 2):
                assert rules.method_for(dtype, rows, threads) in rules.METHODS


@pytest.mark.parametrize("bad, word", [
    ({"float16": {"1": [[None, "grouped_mm"]]}}, "key"),
    ({"float32": {"1": [[None, "onednn"]]}}, "method"),
    ({"float32": {"1": [[4, "grouped_mm"]]}}, "last entry"),
    ({"float32": {"1": [[None, "grouped_mm"], [4, "per_expert"]]}}, "None"),
    ({"float32": {"0": [[None, "grouped_mm"]]}}, "thread key")])
def test_bad_tables_refused(bad, word):
    with pytest.raises(rules.CpuMoeRuleError, match=word):
        rules.check_rules(bad)
    with pytest.raises(rules.CpuMoeRuleError, match="method"):
        rules.forced("onednn")


def test_measured_table_is_the_tuners():
    import json
    with open(rules.RULES_PATH) as f:
        table = json.load(f)
    assert table["source"] == "perf/bench/tune_cpu_moe.py"
    rules.check_rules(table["rules"])


def _tuner(monkeypatch):
    import os

    from repo_paths import PERF
    monkeypatch.syspath_prepend(os.path.join(PERF, "bench"))
    monkeypatch.syspath_prepend(os.path.join(PERF, "harness"))
    import tune_cpu_moe
    return tune_cpu_moe


def test_tuner_takes_grouped_mm_only_where_faster_at_every_shape(monkeypatch):
    tune = _tuner(monkeypatch)

    def cell(per_expert, grouped_mm):
        return {"per_expert": {"median_s": per_expert}, "grouped_mm": {"median_s": grouped_mm}}
    cells = {"a": {1: cell(1.0, 0.5), 8: cell(1.0, 0.5), 64: cell(1.0, 0.97), 512: cell(1.0, 0.5)},
             "b": {1: cell(2.0, 1.0), 8: cell(1.0, 1.2), 64: cell(1.0, 0.5), 512: cell(1.0, 0.5)}}
    chosen = tune.choose(cells, margin=0.05)
    assert {r: m for r, (m, _) in chosen.items()} == {
        1: "grouped_mm", 8: "per_expert", 64: "per_expert", 512: "grouped_mm"}
    assert tune.rule_from(chosen) == [[1, "grouped_mm"], [64, "per_expert"], [None, "grouped_mm"]]


def test_tuner_runs_and_writes_a_valid_table(tmp_path, monkeypatch):
    import json
    tune = _tuner(monkeypatch)
    out, threads = tmp_path / "tune.json", torch.get_num_threads()
    try:
        tune.main(["--threads", "1", "--repeats", "1", "--rows", "1", "3", "--layers", "1",
                   "--flush-mb", "1", "--dtypes", "float32", "--no-write", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    got = json.loads(out.read_text())
    rules.check_rules(got["rules"])
    assert sorted(got["rules"]) == ["float32"] and sorted(got["rules"]["float32"]) == ["1"]
    cell = got["seconds"]["bench50m,float32,1"]["3"]
    assert cell["max_abs_diff"] < 1e-5 and cell["per_expert"]["median_s"] > 0
