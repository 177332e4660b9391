"""The measured op rules for int8/int4 weights on CPU (kernels/cpu_qgemm_rules.py): the rule
picks what its table says (thread keys, catch-all, DEFAULT for what the table lacks), bad
tables are refused by name, and every op of every (format, activation dtype, rows) equals the
float reference ``qlinear_ref``; the int4 dequantiser reads torch's CPU layout exactly."""
import pytest
import torch

from megainfer.kernels import cpu_qgemm_rules as rules
from megainfer.kernels.cpu_qgemm import dequantize_int4_cpu_t, qlinear, qlinear_split
from megainfer.kernels.weight_quant import QuantizedWeight, WeightFormat, dequantize, quantize
from megainfer.kernels.weight_quant import qlinear_ref

TABLE = {"int8/bfloat16": {"1": [[2, "weight_only"], [None, "dequant"]],
                           "2": [[8, "weight_only"], [None, "dequant"]]}}


def _qw(N, K, fmt, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    data, scale = quantize(torch.randn(N, K, generator=g) / K ** 0.5, fmt, dtype)
    return QuantizedWeight(data, scale, fmt, (N, K))


def test_rule_picks_its_table():
    with rules.use_rules(TABLE):
        assert [rules.method_for("int8", torch.bfloat16, r, 1) for r in (1, 2, 3, 64)] == [
            "weight_only", "weight_only", "dequant", "dequant"]
        assert rules.method_for("int8", torch.bfloat16, 8, 2) == "weight_only"
        assert rules.method_for("int8", torch.bfloat16, 8, 16) == "weight_only"  # largest <= 16
        assert rules.method_for("int8", torch.bfloat16, 9, 2) == "dequant"
        # a key the table lacks takes DEFAULT: fp32 activations never row by row
        assert rules.method_for("int8", torch.float32, 1, 1) == "dequant"
        assert rules.method_for("int4", torch.bfloat16, 1, 1) == "weight_only"
    with rules.use_rules({"int8/bfloat16": {"2": [[None, "dequant"]]}}):
        assert rules.method_for("int8", torch.bfloat16, 1, 1) == "dequant"  # smallest key


def test_measured_table_loads():
    for key in rules.KEYS:
        fmt, dtype = key.split("/")
        for rows in (1, 8, 64, 4096):
            assert rules.method_for(fmt, getattr(torch, dtype), rows, 1) in rules.METHODS
        if dtype == "float32":  # the weight-only kernels run fp32 activations row by row
            assert rules.method_for(fmt, torch.float32, 1, 1) == "dequant"


@pytest.mark.parametrize("bad, word", [
    ({"fp8/float32": {"1": [[None, "dequant"]]}}, "key"),
    ({"int8/float32": {"1": [[None, "mm"]]}}, "method"),
    ({"int8/float32": {"1": [[4, "dequant"]]}}, "last entry"),
    ({"int8/float32": {"1": [[None, "dequant"], [4, "dequant"]]}}, "None"),
    ({"int8/float32": {"1": [[4, "dequant"], [2, "dequant"], [None, "dequant"]]}}, "ascending"),
    ({"int8/float32": {"0": [[None, "dequant"]]}}, "thread key")])
def test_bad_tables_refused(bad, word):
    with pytest.raises(rules.CpuQgemmRuleError, match=word):
        rules.check_rules(bad)


@pytest.mark.parametrize("G", [32, 64])
@pytest.mark.parametrize("N", [64, 192])
def test_int4_dequantiser_reads_the_cpu_layout(N, G):
    qw = _qw(N, 128, WeightFormat("int4", group_size=G), torch.float32)
    wt = dequantize_int4_cpu_t(qw.data, qw.scale, G)
    assert wt.shape == (128, N)
    torch.testing.assert_close(wt, dequantize(qw).t(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", [WeightFormat("int8"), WeightFormat("int4", group_size=32),
                                 WeightFormat("int4", group_size=64)],
                         ids=["int8", "int4-g32", "int4-g64"])
@pytest.mark.parametrize("method", rules.METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("N", [64, 48])  # 48: int4 rows not in whole 64-row blocks
def test_every_op_matches_reference(fmt, method, dtype, T, N):
    qw = _qw(N, 128, fmt, dtype, seed=T)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 128, generator=g).to(dtype)
    key = rules.rule_key(fmt.name, dtype)
    with rules.use_rules({key: {"1": [[None, method]]}}):
        y = qlinear(x, qw)
    assert y.dtype == dtype and y.shape == (T, N)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), qlinear_ref(x, qw), atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt", [WeightFormat("int8"), WeightFormat("int4", group_size=64)],
                         ids=["int8", "int4-g64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 40])
def test_split_equals_one_call_per_weight(fmt, dtype, T):
    """q/k/v as one GEMM over the concatenated stored weights: the same outputs as one call
    per weight (bit for bit on the weight-only kernels), biases included; the cached copy is
    rebuilt after an in-place write."""
    qws = [_qw(n, 128, fmt, dtype, seed=n) for n in (128, 64, 64)]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, 128, generator=g).to(dtype)
    biases = [torch.randn(q.shape[0], generator=g).to(dtype) for q in qws[:2]] + [None]
    with rules.use_rules({rules.rule_key(fmt.name, dtype): {"1": [[None, "weight_only"]]}}):
        got = qlinear_split(x, qws, biases)
        want = [qlinear(x, q, b) for q, b in zip(qws, biases)]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    got = qlinear_split(x, qws, biases)  # the measured rule
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for a, q, b in zip(got, qws, biases):
        ref = qlinear_ref(x, q, b)
        torch.testing.assert_close(a.float(), ref, atol=tol, rtol=tol)
    qws[1].data.copy_(qws[2].data)
    qws[1].scale.copy_(qws[2].scale)
    torch.testing.assert_close(qlinear_split(x, qws, [None] * 3)[1].float(),
                               qlinear_ref(x, qws[2]), atol=tol, rtol=tol)


def test_split_falls_back_where_int4_rows_break_blocks():
    fmt = WeightFormat("int4", group_size=32)
    qws = [_qw(n, 64, fmt, torch.float32) for n in (64, 48)]
    x = torch.randn(2, 64)
    for a, q in zip(qlinear_split(x, qws, [None, None]), qws):
        torch.testing.assert_close(a, qlinear_ref(x, q), atol=1e-4, rtol=1e-4)
