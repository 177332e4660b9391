"""In-situ calibration: spans of a (synthetic) merged trace -> layer-time fits."""
import pytest

from megainfer.config import ConfigError
from megainfer.perfmodel.model.hardware import LayerFit
from megainfer.perfmodel.model.insitu import fit_error, fit_in_situ, layer_samples
from megainfer.perfmodel.model.layer_times import FittedTimes
from megainfer.perfmodel.model.shapes import ModelShape

K1, K1C, K2, K3, K4, E, TOP_K, PROMPT = 40e-6, 1e-6, 900e-6, 25e-6, 700e-6, 4, 2, 16


def _trace(batches, iters=6, layers=3, noise=0.0):
    """A merged trace as the runtime writes it: an attention rank (pid 0), an expert rank (pid 1)."""
    ev, ts = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "attn dp0"}}], 0.0
    for b in batches:
        for it in range(iters):
            n = b * PROMPT if it == 0 else b  # iteration 0: the prefill
            ctx = PROMPT + it
            for layer in range(layers):
                ta = K2 + n * (K1 + K1C * ctx)
                te = E * K4 + K3 * n * TOP_K
                jit = 1 + noise * ((layer + it) % 3 - 1)
                args = {"iter": it, "layer": layer, "mb": 0, "tokens": n}
                ev.append({"ph": "X", "cat": "attention", "name": f"attn L{layer} mb0", "pid": 0,
                           "tid": 0, "ts": ts, "dur": ta * jit * 1e6, "args": args})
                ev.append({"ph": "X", "cat": "A2E", "name": f"A2E L{layer} mb0", "pid": 0,
                           "tid": 1, "ts": ts, "dur": 50.0, "args": args})
                ev.append({"ph": "X", "cat": "expert", "name": f"expert L{layer} mb0", "pid": 1,
                           "tid": 0, "ts": ts, "dur": te * jit * 1e6, "args": args})
                ts += 1e5
    return {"traceEvents": ev}


def test_samples_skip_prefill_and_other_lanes():
    attn, expert = layer_samples(_trace([8, 32], iters=4, layers=2), PROMPT, TOP_K)
    assert len(attn) == len(expert) == 2 * 3 * 2  # 2 batches x 3 decode iterations x 2 layers
    assert {b for b, _, _ in attn} == {8, 32}
    assert {c for _, c, _ in attn} == {PROMPT + 1, PROMPT + 2, PROMPT + 3}
    assert {p for p, _ in expert} == {8 * TOP_K, 32 * TOP_K}


def test_fit_recovers_the_generating_times():
    attn, expert = layer_samples(_trace([16, 64, 128, 256]), PROMPT, TOP_K)
    fit = fit_in_situ(attn, expert, E)
    for key, want in (("k1", K1), ("k1_ctx", K1C), ("k2", K2), ("k3", K3), ("k4", K4)):
        assert fit[key] == pytest.approx(want, rel=1e-6), key
    err = fit_error(fit, attn, expert, E)
    assert err["attention"]["max"] < 1e-9 and err["expert"]["max"] < 1e-9


def test_fit_feeds_the_model_and_reports_noise():
    attn, expert = layer_samples(_trace([16, 64, 256], noise=0.1), PROMPT, TOP_K)
    fit = fit_in_situ(attn, expert, E)
    err = fit_error(fit, attn, expert, E)
    assert 0.02 < err["expert"]["max"] < 0.2  # noisy samples: the fit no longer passes through all
    shape = ModelShape(name="t", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                       head_dim=16, num_experts=E, top_k=TOP_K, moe_intermediate_size=128,
                       vocab_size=128)
    times = FittedTimes(_cpu(), shape, LayerFit(k1=fit["k1"], k2=fit["k2"], k3=fit["k3"],
                                                k4=fit["k4"], k1_ctx=fit["k1_ctx"], dtype="float32"))
    b = 100  # an expert rank holding all E experts, b tokens routed top-2 evenly
    want = E * K4 + K3 * b * TOP_K
    assert times.t_expert([b * TOP_K / E] * E) == pytest.approx(want, rel=0.1)


def test_one_batch_size_is_refused():
    attn, expert = layer_samples(_trace([64]), PROMPT, TOP_K)
    with pytest.raises(ConfigError, match=">= 2 batch sizes"):
        fit_in_situ(attn, expert, E)


def _cpu():
    from megainfer.perfmodel.model.hardware import load_hardware
    return load_hardware("cpu_node")
