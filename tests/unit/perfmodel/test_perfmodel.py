"""Formulas of the performance model on hand-computed cases; profiles and bad input."""
import math

import pytest

from megainfer.config import ConfigError
from megainfer.perfmodel.model.fit import fit_attention, fit_line
from megainfer.perfmodel.model.hardware import (LayerFit, LinkProfile, UnknownHardwareError,
                                          known_hardware, load_hardware)
from megainfer.perfmodel.model.disagg import DisaggModel, Plan, Workload
from megainfer.perfmodel.model.layer_times import FittedTimes, RooflineTimes, allreduce_time
from megainfer.perfmodel.model.pipeline import (balanced_replicas, comm_hidden, m_min, micro_batch_sizes,
                                          t_total, t_total_design)
from megainfer.perfmodel.model.shapes import ModelShape
from perfmodel_helpers import TINY, synthetic_hw


def test_t_total_design_hand_case():
    # (1 + 1 + 2*0.25) + 1 * (3*2 - 1) = 7.5
    assert t_total_design(1.0, 1.0, 0.25, 3, 2) == pytest.approx(7.5)
    assert t_total(1.0, 1.0, 0.25, 3, 2) == pytest.approx(7.5)
    assert comm_hidden(1.0, 1.0, 0.25, 3)


def test_t_total_when_comm_not_hidden():
    # m = 1: every layer is a full round trip: L * R = 2 * 2.5 = 5 (the hidden-comm formula says 3.5)
    assert t_total(1.0, 1.0, 0.25, 1, 2) == pytest.approx(5.0)
    assert t_total_design(1.0, 1.0, 0.25, 1, 2) == pytest.approx(3.5)
    # m = 2, R = 2.5 > m T_f = 2: L R + (m - 1) T_f = 4 * 2.5 + 1 = 11
    assert t_total(1.0, 1.0, 0.25, 2, 4) == pytest.approx(11.0)
    assert not comm_hidden(1.0, 1.0, 0.25, 2)
    # link-bound: T_c = 3 > T_f: R = 8, T_s = 3, m=4, L=2: max(8 + 7*3, 16 + 9) = 29
    assert t_total(1.0, 1.0, 3.0, 4, 2) == pytest.approx(29.0)


def test_m_min_and_token_conservation():
    assert m_min(0.5, 1.0) == pytest.approx(3.0)  # T_c = T_f / 2 -> m = 3
    assert m_min(0.0, 1.0) == pytest.approx(2.0)
    b_a, b_e = micro_batch_sizes(96, 3, 4, 8, 2)
    assert (b_a, b_e) == (8.0, 8.0)
    assert b_a * 3 * 4 == 96 and b_e * 3 * 8 / 2 == 96
    assert balanced_replicas(2e-5, 1e-5, 8, 2) == pytest.approx(8.0)
    assert balanced_replicas(2e-5, 1e-5, 8, 2, experts_per_rank=2) == pytest.approx(4.0)
    with pytest.raises(ConfigError, match="m_min"):
        m_min(1.0, 0.0)


def test_link_time_and_curve():
    link = LinkProfile(1e-5, 1e9)
    assert link.time(1e6) == pytest.approx(1e-5 + 1e-3)
    curved = LinkProfile(1e-5, 1e9, ((1e3, 0.5), (1e5, 1.0)))
    assert curved.utilisation(1e4) == pytest.approx(0.75)  # log-midpoint
    assert curved.utilisation(10) == 0.5 and curved.utilisation(1e9) == 1.0
    assert curved.time(2e4, n_msgs=2) == pytest.approx(1e-5 + 2e4 / 0.75e9)
    with pytest.raises(ConfigError, match="curve"):
        LinkProfile(0, 1e9, ((1e5, 1.0), (1e3, 0.5)))


def test_roofline_expert_hand_case():
    hw = synthetic_hw(flops=1e12, bw=1e11, overhead=0.0)
    rt = RooflineTimes(hw, TINY, "bfloat16")
    p = 3 * 64 * 128  # one expert's params
    # b = 10: FLOPs 2*10*p / 1e12 = 4.9152e-7 s; bytes p*2 + 10*(2*64 + 2*128)*2 = 56832 -> 5.6832e-7 s
    assert rt.t_expert([10]) == pytest.approx(max(2 * 10 * p / 1e12, (p * 2 + 10 * 384 * 2) / 1e11))
    assert rt.t_expert([10]) == pytest.approx(5.6832e-7)
    assert rt.t_expert([0, 0]) == 0.0
    # two experts, one idle: only the active one's weights are read
    assert rt.t_expert([10, 0]) == pytest.approx(rt.t_expert([10]))
    # compute-bound at large b: 2*b*p/F
    assert rt.t_expert([100000]) == pytest.approx(2 * 100000 * p / 1e12)


def test_roofline_attention_hand_case():
    hw = synthetic_hw(flops=1e15, bw=1e11, overhead=0.0)  # memory-bound
    rt = RooflineTimes(hw, TINY, "bfloat16")
    b, ctx = 4, 100
    weights = (64 * (2 * 64 + 2 * 32) + 64 * 8) * 2  # q/k/v/o + router, bf16
    kv = b * ctx * 2 * 2 * 16 * 2  # b * ctx * (2 * kv_heads * head_dim) * 2 bytes
    act = 6 * b * 64 * 2
    assert rt.t_attn(b, ctx) == pytest.approx((weights + kv + act) / 1e11)


def test_fitted_times_and_allreduce():
    hw = synthetic_hw()
    ft = FittedTimes(hw, TINY, LayerFit(k1=1e-4, k2=1e-3, k3=2e-4, k4=5e-4, k1_ctx=1e-7))
    assert ft.t_attn(10, 0) == pytest.approx(2e-3)
    assert ft.t_attn(10, 100) == pytest.approx(1e-3 + 10 * (1e-4 + 1e-5))
    assert ft.t_expert([4, 0, 2]) == pytest.approx((5e-4 + 8e-4) + (5e-4 + 4e-4))
    # ring all-reduce: 2 (tp-1) latencies + 2 (tp-1)/tp bytes / bw
    assert allreduce_time(hw, 1e6, 4) == pytest.approx(6 * 0.5e-6 + 1.5e6 / 4e10)
    assert allreduce_time(hw, 1e6, 1) == 0.0


def test_fits_recover_coefficients():
    xs = [1, 2, 4, 8, 16]
    k, c = fit_line(xs, [3e-5 * x + 2e-4 for x in xs])
    assert k == pytest.approx(3e-5) and c == pytest.approx(2e-4)
    bs, cs = [1, 4, 16, 1, 4, 16], [128] * 3 + [512] * 3
    ys = [1e-3 + b * (2e-5 + 1e-8 * c) for b, c in zip(bs, cs)]
    k1, k1c, k2 = fit_attention(bs, cs, ys)
    assert (k1, k1c, k2) == pytest.approx((2e-5, 1e-8, 1e-3), rel=1e-6)
    with pytest.raises(ConfigError, match="distinct"):
        fit_line([2, 2], [1, 1])


def test_memory_mixtral_8x22b_expert_rank():
    import yaml, os, megainfer.conf
    with open(os.path.join(os.path.dirname(megainfer.conf.__file__), "plan_model", "mixtral_8x22b.yaml")) as f:
        d = yaml.safe_load(f)
    shape = ModelShape.from_dict({k: v for k, v in d.items() if k != "name"}, d["name"])
    hw = load_hardware("a100_80g")
    m = DisaggModel(shape, RooflineTimes(hw, shape), RooflineTimes(hw, shape), Workload(1024, 512))
    plan = Plan(tp_a=2, n_a=2, tp_e=1, n_e=8, m=2, batch=8)
    assert m.mem_expert(plan) == 56 * 3 * 6144 * 16384 * 2  # one expert, bf16: 33.8 GB
    # attention: weights / tp + B/n_a sequences * 1536 slots * 56 layers * (2*8*128 / 2) * 2 bytes
    w = shape.attention_side_params() * 2 / 2
    assert m.mem_attention(plan) == pytest.approx(w + 4 * 1536 * 56 * 1024 * 2)
    # T_c: each replica sends b_a*K*H*2 bytes over tp_a NICs as n_e messages; expert receives b_e*H*2
    b_a, b_e = 2.0, 0.5
    send = hw.inter_link.time(b_a * 2 * 6144 * 2 / 2, 8)
    recv = hw.inter_link.time(b_e * 6144 * 2, 2)
    assert m.t_comm(b_a, b_e, plan) == pytest.approx(max(send, recv))
    p = m.predict(plan)
    assert p.t_total == pytest.approx(t_total(p.t_a, p.t_e, p.t_c, 2, 56))
    assert p.tokens_per_s == pytest.approx(8 / (p.t_total + p.t_head))
    assert p.cost_per_hour == pytest.approx(12 * hw.price_per_hour)


def test_presets_load_and_sources_noted():
    names = known_hardware()
    for n in ("a100_80g", "h100", "h800", "h20", "l40s", "h200"):
        assert n in names
        hw = load_hardware(n)
        assert hw.flops("bfloat16") > 1e14 and hw.mem_bytes > 40e9 and hw.price_per_hour > 0
        assert "nvidia" in hw.source.lower() and "tflops" in hw.source.lower()  # source noted
    assert load_hardware("h100").flops("bfloat16") == pytest.approx(989.4e12)


def test_bad_inputs_name_the_culprit():
    with pytest.raises(UnknownHardwareError, match="hardware='tpu9'.*known: .*h100"):
        load_hardware("tpu9")
    with pytest.raises(ConfigError, match="model.top_k"):
        ModelShape(name="x", hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                   num_experts=2, top_k=3, moe_intermediate_size=8, vocab_size=8)
    with pytest.raises(ConfigError, match="model.hidden_size: missing"):
        ModelShape.from_dict({"num_layers": 1})
    with pytest.raises(ConfigError, match="model.foo: unknown key"):
        ModelShape.from_dict({"foo": 1})
    with pytest.raises(ConfigError, match="plan.n_a"):
        Plan(tp_a=1, n_a=0, tp_e=1, n_e=1, m=1, batch=1)
    with pytest.raises(ConfigError, match="no matmul_flops for dtype='fp8'"):
        synthetic_hw().flops("fp8")
    with pytest.raises(ConfigError, match="workload.input_len"):
        Workload(0, 5)
    assert math.isfinite(load_hardware("l40s").inter_link.time(1e6))
