"""The engine on a CUDA device, end to end (``pytest -m gpu``; perf/gpu_session.sh runs them).

(a) fp32, torch and Triton attention: greedy tokens identical to HF fp32 ``generate`` on cuda;
(b) bf16: close to HF bf16 in vLLM's sense (parity_util.check_greedy_close, top-5), one case
    past position 2000;
(c) CUDA graphs on and off: identical tokens (fp32), with batches that need padding;
(d) host synchronisations in one decode step, graphs off and on: at most SYNC_BUDGET;
(e) Triton vs torch attention through the whole engine: identical greedy tokens (fp32);
(f) a frontend's resolution (a plain script starting its ranks) opens no CUDA context.
Tests that need transformers (the oracle, and the tiny checkpoints) skip without it.
"""
import os
import warnings

import pytest
import torch

from conftest import FAMILIES
from megainfer import LLM
from parity_util import check_greedy_close, hf_greedy
from test_engine_generate import greedy, prompts

DEV = "cuda"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(),
                                 reason="needs a CUDA device")]

# One decode step may synchronise the host with the device this often:
#   1  the device->host copy of the sampled tokens (Sampler.__call__'s tolist): the scheduler
#      needs them on the host to extend and stop requests;
#   +1 allowance: the step's one host->device copy of its inputs (token ids, positions, slots,
#      block tables; AttentionMetadata.build_with, or the graph rows), which torch counts as a
#      synchronisation when its source is not pinned memory.
# Anything beyond (an .item() or .tolist() inside the model, sampler or MoE routing, a
# torch.cuda.synchronize) stalls the launch queue each step and fails the test.
SYNC_BUDGET = 2


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        j = first_difference(g, w)
        assert j is None, (f"{what}: prompt {i} differs from token {j} on: ours {g[j:j + 5]}..., "
                           f"reference {w[j:j + 5]}...")
    assert len(got) == len(want)


@pytest.fixture(scope="module")
def ckpts(request):
    """The session's tiny checkpoints (making them needs transformers)."""
    pytest.importorskip("transformers")
    return request.getfixturevalue("tiny_ckpts")


@pytest.fixture(scope="module")
def hf_on_device():
    """HF models on DEV in a dtype, loaded once per (checkpoint, dtype)."""
    transformers = pytest.importorskip("transformers")
    cache = {}

    def get(path, dtype):
        if (path, dtype) not in cache:
            cache[(path, dtype)] = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype).to(DEV).eval()
        return cache[(path, dtype)]
    yield get
    cache.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_identical_to_hf(ckpts, hf_on_device, family, backend):
    path = ckpts[(family, "base")]
    ps = prompts(5, seed=1) + prompts(1, seed=2, lo=100, hi=100)
    llm = LLM(path, device=DEV, dtype="float32", attention_backend=backend, max_model_len=256,
              max_num_seqs=8, max_num_batched_tokens=64)
    got = tokens(llm.generate(ps, greedy(24), use_tqdm=False))
    hf = hf_on_device(path, torch.float32)
    assert_same(got, [hf_greedy(hf, p, 24) for p in ps], f"{family} {backend} fp32 vs HF")


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    """A tiny qwen3_moe checkpoint with 4096 positions (the session's have 512)."""
    pytest.importorskip("transformers")
    from megainfer.tools.make_tiny import make_tiny
    return make_tiny("qwen3_moe", str(tmp_path_factory.mktemp("long") / "qwen3_moe_4k"), seed=1,
                     max_pos=4096)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_close_to_hf(ckpts, hf_on_device, family):
    path = ckpts[(family, "base")]
    ps = prompts(6, seed=3, lo=1, hi=120)
    llm = LLM(path, device=DEV, dtype="bfloat16", max_model_len=256, max_num_seqs=8)
    hf = hf_on_device(path, torch.bfloat16)
    for p, out in zip(ps, tokens(llm.generate(ps, greedy(32), use_tqdm=False))):
        check_greedy_close(out, hf, p, k=5)


def test_bf16_close_to_hf_past_position_2000(long_ckpt, hf_on_device):
    ps = prompts(2, seed=4, lo=2040, hi=2060) + prompts(1, seed=5, lo=300, hi=300)
    llm = LLM(long_ckpt, device=DEV, dtype="bfloat16", max_model_len=4096, max_num_seqs=4,
              max_num_batched_tokens=512)  # the long prompts prefill in chunks
    outs = tokens(llm.generate(ps, greedy(40), use_tqdm=False))
    hf = hf_on_device(long_ckpt, torch.bfloat16)
    assert min(len(p) for p in ps[:2]) >= 2040  # positions 2040..2100 generated
    for p, out in zip(ps, outs):
        check_greedy_close(out, hf, p, k=5)


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graphs_on_off_identical(ckpts, family):
    """11 prompts of different lengths and output lengths: as requests finish the decode batch
    shrinks 11 -> 1 through the graph sizes (1, 2, 4, 8, 16), padded in between."""
    path = ckpts[(family, "base")]
    ps = prompts(11, seed=6, lo=1, hi=60)
    params = [greedy(3 + 3 * i) for i in range(len(ps))]
    runs = {}
    for graphs in (False, True):
        llm = LLM(path, device=DEV, dtype="float32", attention_backend="triton",
                  cuda_graphs=graphs, max_model_len=256, max_num_seqs=16)
        assert llm.device_config.cuda_graphs is (graphs and DEV == "cuda")
        runs[graphs] = tokens(llm.generate(ps, params, use_tqdm=False))
        del llm
    assert [len(t) for t in runs[True]] == [p.max_tokens for p in params]
    assert_same(runs[True], runs[False], f"{family}: CUDA graphs on vs off")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp32_cuda_graphs_match_hf_with_padding(ckpts, hf_on_device, backend):
    """Graphs on, a decode batch of 5 padded to 8: still HF's tokens."""
    path = ckpts[("qwen2_moe", "base")]
    ps = prompts(5, seed=7, lo=3, hi=50)
    llm = LLM(path, device=DEV, dtype="float32", attention_backend=backend, cuda_graphs=True,
              max_model_len=128, max_num_seqs=8)
    hf = hf_on_device(path, torch.float32)
    assert_same(tokens(llm.generate(ps, greedy(16), use_tqdm=False)),
                [hf_greedy(hf, p, 16) for p in ps], f"qwen2_moe {backend} graphs vs HF")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the Triton interpreter copies every kernel's tensors through the host")
@pytest.mark.skipif(DEV != "cuda", reason="counts CUDA synchronisations")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_decode_step_host_syncs(ckpts, monkeypatch, graphs):
    llm = LLM(ckpts[("qwen3_moe", "base")], device=DEV, attention_backend="triton",
              cuda_graphs=graphs, max_model_len=128, max_num_seqs=8)
    ps = prompts(5, seed=8, lo=5, hi=30)
    llm.generate(ps, greedy(4), use_tqdm=False)  # warm-up: Triton compiles, graph of batch 8
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request(f"sync{i}", prompt_token_ids=p, params=greedy(16))
    while not all(r.output_token_ids for r in eng.requests.values()):  # prefill
        eng.step()
    assert len(eng.requests) == len(ps)
    before = {r.request_id: len(r.output_token_ids) for r in eng.requests.values()}
    torch.cuda.synchronize()
    explicit = []
    real_sync = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *a, **k: (explicit.append("torch.cuda.synchronize"), real_sync(*a, **k)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.step()  # one pure decode step of 5 sequences
        finally:
            torch.cuda.set_sync_debug_mode("default")
    monkeypatch.undo()
    assert all(len(r.output_token_ids) == before[r.request_id] + 1 for r in eng.requests.values())
    syncs = [f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught
             if "synchroniz" in str(w.message).lower()] + explicit
    assert len(syncs) <= SYNC_BUDGET, (
        f"one decode step ({'graphs' if graphs else 'eager'}) synchronised {len(syncs)} times, "
        f"budget {SYNC_BUDGET} (sampled tokens + one input copy): {syncs}")
    while eng.has_unfinished():
        eng.step()


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_and_torch_attention_identical(ckpts, family):
    path = ckpts[(family, "base")]
    ps = prompts(4, seed=9, lo=1, hi=60) + prompts(2, seed=10, lo=200, hi=300)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, device=DEV, dtype="float32", attention_backend=backend,
                  max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128)
        runs[backend] = tokens(llm.generate(ps, greedy(32), use_tqdm=False))
        del llm
    assert_same(runs["triton"], runs["torch"], f"{family}: Triton vs torch attention")


PRIMARY_CONTEXT = """import sys, torch
from megainfer.config import ModelConfig
from megainfer.engine.job_doors import resolve_llm_job
tiny = ModelConfig(family="mixtral", vocab_size=300, hidden_size=32, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=16, num_experts=2, top_k=1, moe_intermediate_size=32,
                   max_position_embeddings=64)
job = resolve_llm_job({"gpu_memory_utilization": 0.5, "num_blocks": None}, tiny,
                      sys.argv[1], None, None, ["deploy.device=cuda"]).job
assert job.device.device == "cuda" and job.cache.num_blocks > 0
print(torch._C._cuda_hasPrimaryContext(0))
"""


@pytest.mark.parametrize("deploy,opens", [("single", True), ("a1e2", False)])
def test_a_frontend_resolution_opens_no_cuda_context(deploy, opens):
    """(f) ``gpu_memory_utilization`` sizing: single mode's own process measures free memory
    (its CUDA context opens); a plain script that will start a1e2's ranks reads the GPU's total
    memory and holds no context (tests/unit/engine/test_resolve.py checks the same on CPU)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", PRIMARY_CONTEXT, deploy], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(opens), out.stdout
