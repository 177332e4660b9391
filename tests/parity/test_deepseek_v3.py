"""DeepSeek-V3 (MLA, YaRN, sigmoid group-limited routing) and DeepSeek-V2 (same MLA, softmax
greedy / group_limited_greedy routing) against HF transformers, fp32 on CPU.

Tiny checkpoints: 4 layers (2 dense + 2 MoE), 8 experts in 4 groups (2 kept, top-2), YaRN
factor 4 over an original context of 64 with mscale != mscale_all_dim; prompts run past 64.
"""
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megainfer import LLM, SamplingParams
from megainfer.config import ConfigError, LoadConfig, ModelConfig
from megainfer.engine.sizing import kv_bytes_per_block
from megainfer.models import AttentionMetadata, ParallelContext, build_model
from megainfer.models import mla_attention
from megainfer.models.deepseek_v3 import rope_parameters, softmax_scale
from megainfer.models.kv_spec import kv_cache_spec_for
from megainfer.models.loader import ConfigMismatchError
from tp_threads import run_tp_threads
from repo_paths import MPI_PROGS

QLORA = [None, 24]  # q_proj, or q_a_proj / q_a_layernorm / q_b_proj
V2_GREEDY = ("deepseek_v2", "greedy")  # V2 without groups (n_group 1), q_lora_rank 24
# (family, q_lora_rank or V2's greedy variant) -> checkpoint; V2 None: group_limited_greedy
CASES = [("deepseek_v3", None), ("deepseek_v3", 24), ("deepseek_v2", None), V2_GREEDY]
IDS = ["v3-q_proj", "v3-q_lora", "v2-groups", "v2-greedy-q_lora"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from megainfer.tools.make_tiny import make_tiny
    root = tmp_path_factory.mktemp("deepseek")
    out = {q: make_tiny("deepseek_v3", str(root / f"q{q}"), seed=1, q_lora_rank=q) for q in QLORA}
    out[("deepseek_v3", None)], out[("deepseek_v3", 24)] = out[None], out[24]
    out[("deepseek_v2", None)] = make_tiny("deepseek_v2", str(root / "v2_groups"), seed=1)
    out[V2_GREEDY] = make_tiny("deepseek_v2", str(root / "v2_greedy"), seed=1, q_lora_rank=24,
                               n_group=1, topk_group=1)
    return out


@pytest.fixture(scope="module")
def hf(ckpts):
    import transformers
    cache = {}

    def get(q):
        if q not in cache:
            cache[q] = transformers.AutoModelForCausalLM.from_pretrained(ckpts[q]).eval()
        return cache[q]
    return get


def _ours(path, **kw):
    return build_model(ModelConfig.from_pretrained(path), LoadConfig(path=path), **kw)


def _ids(n, seed=0, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _cached(model, ids, chunks, block_size=4):
    """ids through the paged latent cache in chunks (chunks of 1 take the absorbed decode)."""
    caches = model.kv_cache_spec().allocate(64, block_size)
    blocks = list(range(5, 5 + -(-len(ids) // block_size)))
    out, done = [], 0
    for n in chunks:
        meta = AttentionMetadata.build([n], [done], [blocks], block_size)
        out.append(model.compute_logits(model(ids[done:done + n], torch.arange(done, done + n),
                                              meta, caches)))
        done += n
    return torch.cat(out)


def test_config_reads_deepseek_fields(ckpts):
    cfg = ModelConfig.from_pretrained(ckpts[24])
    assert cfg.family == "deepseek_v3" and cfg.is_mla and cfg.q_lora_rank == 24
    dims = (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    assert dims == (32, 16, 8, 16)
    routing = (cfg.n_group, cfg.topk_group, cfg.scoring, cfg.routed_scaling_factor)
    assert routing == (4, 2, "sigmoid", 2.5)
    assert cfg.moe_layers() == [2, 3] and cfg.dense_layers() == [0, 1] and cfg.mtp_layers == 1
    y = cfg.rope_scaling
    yarn = (y.factor, y.original_max_position_embeddings, y.mscale, y.mscale_all_dim)
    assert yarn == (4.0, 64, 1.0, 0.8)


def test_yarn_tables_and_scale_exactly_hf(ckpts, hf):
    cfg, ref = ModelConfig.from_pretrained(ckpts[None]), hf(None)
    inv, factor = rope_parameters(cfg)
    assert inv.dtype == torch.float32 and torch.equal(inv, ref.model.rotary_emb.inv_freq)
    assert factor == ref.model.rotary_emb.attention_scaling != 1.0
    assert softmax_scale(cfg) == ref.model.layers[0].self_attn.scaling
    ours = _ours(ckpts[None])  # built on meta, buffers recomputed by init_buffers
    assert torch.equal(ours.layers[3].self_attn.rotary.inv_freq, inv)


@pytest.mark.parametrize("q", CASES, ids=IDS)
@pytest.mark.parametrize("length", [1, 7, 100])
def test_logits_match_transformers(ckpts, hf, q, length):
    model, ids = _ours(ckpts[q]), _ids(length, length)
    with torch.no_grad():
        ref = hf(q)(ids[None]).logits[0]
        got = model.compute_logits(model(ids, torch.arange(length)))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("q", CASES, ids=IDS)
def test_chunked_prefill_and_absorbed_decode_match_hf(ckpts, hf, q):
    """Prefill chunks read back the cached latents (expanded); the 1-token steps are the
    absorbed decode: logits within 1e-5 of HF's expanded attention over the whole sequence."""
    model, ids = _ours(ckpts[q]), _ids(100, 3)
    with torch.no_grad():
        ref = hf(q)(ids[None]).logits[0]
        got = _cached(model, ids, [50, 20, 1, 1, 1, 17, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_absorbed_decode_equals_expanded_attention(ckpts):
    """mla_decode_torch (latent space, cache never expanded per head) vs HF's expanded form."""
    attn = _ours(ckpts[24]).layers[2].self_attn
    g = torch.Generator().manual_seed(7)
    S, L, BS, H = 3, [70, 9, 33], 4, attn.heads
    R, P, N = attn.kv_lora_rank, attn.rope_dim, attn.nope_dim
    cache = torch.randn(64, BS, R + P, generator=g)
    tables = torch.randperm(64, generator=g)[:3 * 18].view(3, 18)
    q_nope, q_pe = torch.randn(S, H, N, generator=g), torch.randn(S, H, P, generator=g)
    with torch.no_grad():
        o_lat = mla_attention.mla_decode_torch(attn.absorb_q(q_nope), q_pe, cache,
                                               torch.tensor(L), tables, attn.scale)
        got = attn.unabsorb_o(o_lat)  # [S, H, V]
        for s in range(S):
            lat = cache[tables[s]].reshape(-1, R + P)[:L[s]]
            want = mla_attention.expanded_attention(attn, q_nope[s:s + 1], q_pe[s:s + 1], lat,
                                                    L[s] - 1)
            torch.testing.assert_close(got[s], want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q", CASES, ids=IDS)
def test_llm_greedy_tokens_equal_hf(ckpts, hf, q, monkeypatch):
    """LLM(path), single mode: prefill spans steps (max_num_batched_tokens=32), decode steps
    take the absorbed path; greedy tokens identical to HF generate; the latent cache's shape."""
    calls = []
    real = mla_attention.mla_decode_torch
    monkeypatch.setattr(mla_attention, "mla_decode_torch",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    llm = LLM(ckpts[q], max_num_batched_tokens=32, max_num_seqs=4, block_size=4, num_blocks=128)
    kv = llm.engine.kv_caches
    assert llm.engine.kv_spec.kind == "mla" and len(kv) == 4
    assert tuple(kv[0].shape) == (128, 4, 32 + 8)  # [num_blocks, block_size, R + P]
    prompts = [_ids(90, 11).tolist(), _ids(75, 12).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert calls, "decode steps did not take the absorbed path"
    with torch.no_grad():
        for p, out in zip(prompts, outs):
            want = hf(q).generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                                  min_new_tokens=10)[0, len(p):].tolist()
            assert out.outputs[0].token_ids == want


def test_tensor_parallel_heads_match_single(ckpts):
    """Two TP ranks (threads, a real sum all-reduce): heads split, full latent cache on each."""
    src, ids = ckpts[24], _ids(72, 5)
    chunks = [40, 30, 1, 1]
    with torch.no_grad():
        want = _cached(_ours(src), ids, chunks)

    def run(rank, all_reduce):
        m = _ours(src, par=ParallelContext(rank, 2, all_reduce))
        assert m.layers[0].self_attn.heads == 2
        assert m.kv_cache_spec().shape_per_token == (40,)
        with torch.no_grad():
            return _cached(m, ids, chunks)
    outs = run_tp_threads(run)
    for o in outs:
        torch.testing.assert_close(o, want, atol=1e-5, rtol=1e-5)


def test_mtp_layer_skipped_other_extra_layers_refused(ckpts, tmp_path):
    src = ckpts[None]
    want = _ours(src)

    def copy_with(name, extra):
        d = tmp_path / name
        shutil.copytree(src, d)
        f = os.path.join(d, "model.safetensors")
        t = load_file(f)
        t.update(extra)
        save_file(t, f)
        return str(d)
    mtp = copy_with("mtp", {"model.layers.4.eh_proj.weight": torch.zeros(64, 128),
                            "model.layers.4.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64)})
    got = _ours(mtp)
    ids = _ids(9)
    with torch.no_grad():
        torch.testing.assert_close(got.compute_logits(got(ids, torch.arange(9))),
                                   want.compute_logits(want(ids, torch.arange(9))), atol=0, rtol=0)
    bad = copy_with("bad", {"model.layers.5.eh_proj.weight": torch.zeros(4)})
    with pytest.raises(ConfigMismatchError, match="layer 5"):
        _ours(bad)


def test_router_stays_fp32_and_bf16_runs(ckpts):
    path = ckpts[24]
    m = build_model(ModelConfig.from_pretrained(path), LoadConfig(path=path, dtype="bfloat16"))
    gate = m.layers[2].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert m.layers[2].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    assert gate.e_score_correction_bias.abs().sum() > 0
    ids = _ids(20)
    with torch.no_grad():
        caches = m.kv_cache_spec().allocate(16, 4)
        assert caches[0].dtype == torch.bfloat16
        meta = AttentionMetadata.build([20], [0], [list(range(5))], 4)
        out = m.compute_logits(m(ids, torch.arange(20), meta, caches))
    assert torch.isfinite(out).all()


def test_dummy_weights_generate():
    cfg = ModelConfig.from_hf_dict(_real_v3(num_hidden_layers=3, hidden_size=64, vocab_size=128,
                                            num_attention_heads=2, n_routed_experts=8,
                                            moe_intermediate_size=16, intermediate_size=32,
                                            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
                                            qk_nope_head_dim=8, v_head_dim=8,
                                            first_k_dense_replace=1, max_position_embeddings=256,
                                            n_group=4, topk_group=2, num_experts_per_tok=2))
    out = LLM(cfg, seed=3, max_num_seqs=2, num_blocks=64).generate(
        [[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def _real_v3(**over):
    """deepseek-ai/DeepSeek-V3 config.json (the fields we read), optionally overridden."""
    cfg = {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
           "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
           "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
           "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
           "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
           "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
           "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
           "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
           "rope_theta": 10000, "num_nextn_predict_layers": 1, "bos_token_id": 0,
           "eos_token_id": 1, "tie_word_embeddings": False,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                            "type": "yarn"}}
    cfg.update(over)
    return json.loads(json.dumps(cfg))


def test_kv_bytes_per_token_real_deepseek_v3():
    """The latent cache of DeepSeek-V3 vs caching its expanded keys and values GQA-style."""
    cfg = ModelConfig.from_hf_dict(_real_v3())
    assert cfg.moe_layers()[0] == 3 and cfg.top_k == 8 and cfg.mtp_layers == 1
    spec = kv_cache_spec_for(cfg, dtype=torch.bfloat16)
    mla = spec.bytes_per_token()
    assert spec.kind == "mla" and spec.shape_per_token == (576,) and mla == 576 * 61 * 2
    assert kv_bytes_per_block(cfg, 16, torch.bfloat16) == 16 * mla
    qk_head, v_head = 128 + 64, 128  # HF's DynamicCache would hold k [H, 192] and v [H, 128]
    gqa = 128 * (qk_head + v_head) * 61 * 2
    print(f"DeepSeek-V3 KV bytes/token (bf16, 61 layers): MLA latent {mla} "
          f"vs expanded GQA-style {gqa} ({gqa / mla:.1f}x)")
    assert gqa == 4_997_120 and mla == 70_272
    assert softmax_scale(cfg) == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)


@pytest.mark.parametrize("over,field", [
    (dict(n_group=7), "model.n_group"),
    (dict(topk_group=9), "model.topk_group"),
    (dict(topk_group=1, num_experts_per_tok=40), "model.top_k"),
    (dict(kv_lora_rank=0), "model.kv_lora_rank"),
    (dict(qk_rope_head_dim=63), "model.qk_rope_head_dim"),
    (dict(q_lora_rank=0), "model.q_lora_rank"),
    (dict(first_k_dense_replace=-1), "model.first_k_dense_replace"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type"),
    (dict(rope_scaling={"type": "yarn", "factor": -1.0, "original_max_position_embeddings": 8}),
     "rope_scaling.factor"),
    (dict(scoring_func="softmax"), "scoring_func"),
])
def test_bad_deepseek_config_names_the_field(over, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict(_real_v3(**over))


def test_deepseek_v2_config_routing(ckpts):
    groups = ModelConfig.from_pretrained(ckpts[("deepseek_v2", None)])
    greedy = ModelConfig.from_pretrained(ckpts[V2_GREEDY])
    assert groups.is_mla and groups.scoring == "softmax" and not groups.norm_topk_prob
    assert (groups.n_group, groups.topk_group, greedy.n_group) == (4, 2, 1)
    assert groups.rope_scaling is not None and groups.moe_layers() == [2, 3]
    with pytest.raises(ConfigError, match="topk_method"):
        ModelConfig.from_hf_dict(_real_v3(model_type="deepseek_v2", scoring_func="softmax",
                                          topk_method="noaux_tc"))


def test_yarn_refused_for_other_families():
    cfg = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "intermediate_size": 48,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}
    with pytest.raises(ConfigError, match="rope_type"):
        ModelConfig.from_hf_dict(cfg)


def test_triton_mla_backend_same_tokens(ckpts):
    """attention_backend=triton: Triton latent store + absorbed decode (under the interpreter
    on CPU), prefill on the torch path; the same greedy tokens as the torch backend."""
    pytest.importorskip("megainfer.kernels.triton_mla")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": _ids(n, seed).tolist()} for n, seed in ((70, 13), (9, 14))]
    kw = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=4, num_blocks=64)
    ref = LLM(ckpts[24], **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(ckpts[24], attention_backend="triton", **kw)
    assert isinstance(llm.model.layers[0].self_attn.attn_backend, mla_attention.TritonMLA)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def _mpi_tools():
    """run_mpi, with tests/distributed/mpi_progs importable."""
    import sys
    sys.path.insert(0, MPI_PROGS)
    from mpi_util import run_mpi
    return run_mpi


def _single_mode_tokens(path):
    """{request id: greedy tokens} of tests/distributed/mpi_progs/runtime_job.py's prompts, single mode."""
    _mpi_tools()
    from runtime_job import CACHE, SCHED, inputs

    from megainfer.engine.engine import LLMEngine
    cfg = ModelConfig.from_pretrained(path)
    engine = LLMEngine.from_model(_ours(path), SCHED, CACHE)
    return {o.request_id: o.outputs[0].token_ids
            for o in engine.generate_stream(inputs(cfg.vocab_size, 12))}


# (attention replicas, tp, expert ranks); E=0: colocated
MPI_LAYOUTS = [(1, 2, 1), (2, 1, 0), (1, 1, 2), (2, 1, 2)]


@pytest.mark.parametrize("A,TP,E", MPI_LAYOUTS, ids=["a1tp2e1", "colocated_a2", "a1e2", "a2e2"])
def test_multi_process_modes_equal_single_mode(ckpts, tmp_path, A, TP, E):
    """Disaggregated (TP=2 attention + an expert rank) and colocated runs under real mpiexec
    give single mode's greedy tokens: dense first layers, sigmoid router, shared experts."""
    path = ckpts[24]
    want, run_mpi = _single_mode_tokens(path), _mpi_tools()
    out = tmp_path / "out.json"
    run_mpi(A * TP + E, os.path.join(MPI_PROGS, "runtime_job.py"),
            [out, A, TP, E, "1,2", path], timeout=600)
    got = json.loads(out.read_text())
    for m in (1, 2):
        assert got[f"{path}|m={m}"] == want, m


def test_eplb_placements_keep_tokens(ckpts, tmp_path):
    """A shuffled static placement with redundant slots, then live rebalancing under the model's
    own routing groups (eplb.num_groups defaults to n_group=4): single mode's greedy tokens,
    and every slot ends up holding its logical expert's weights."""
    path = ckpts[24]
    want, run_mpi = _single_mode_tokens(path), _mpi_tools()
    out = tmp_path / "eplb.json"
    run_mpi(3, os.path.join(MPI_PROGS, "eplb_job.py"), [out, path], timeout=600)
    res = json.loads(out.read_text())
    static, live = res["static_shuffled"], res["live"]
    assert static["tokens"] == want and all(static["weights_ok"])
    experts = ModelConfig.from_pretrained(path).num_experts
    assert sorted(set(x for row in static["phy2log"] for x in row)) == list(range(experts))
    assert live["tokens"] == want and all(live["weights_ok"])
    assert min(live["rebalances"]) >= 2 and sum(live["moved"]) > 0
