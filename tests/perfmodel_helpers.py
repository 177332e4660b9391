"""Shared small fixtures for the perfmodel tests: a tiny shape and a synthetic profile."""
from megainfer.perfmodel.model.hardware import profile_from_dict
from megainfer.perfmodel.model.shapes import ModelShape

TINY = ModelShape(name="tiny", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=128, vocab_size=256)


def synthetic_hw(name="synth", **kw) -> object:
    return profile_from_dict(synthetic_profile(name, **kw))


def synthetic_profile(name="synth", flops=1e12, bw=1e11, mem=4e6, price=1.0, latency=1e-6,
                      link_bw=1e10, overhead=2e-6) -> dict:
    """``synthetic_hw``'s profile as the YAML dict ``deploy.hardware=PATH.yaml`` reads."""
    return {
        "name": name, "matmul_flops": {"bfloat16": flops, "float32": flops / 4},
        "mem_bw_Bps": bw, "mem_bytes": mem, "price_per_hour": price,
        "inter_link": {"latency_s": latency, "bandwidth_Bps": link_bw},
        "intra_link": {"latency_s": latency / 2, "bandwidth_Bps": link_bw * 4},
        "matmul_efficiency": 1.0, "mem_efficiency": 1.0, "kernel_overhead_s": overhead,
        "mem_util": 1.0}
