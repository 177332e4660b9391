"""The whole engine with attention_backend=triton (run by the Triton interpreter on CPU in CI,
compiled on a GPU): the same greedy tokens as Hugging Face and as the torch backend, through
chunked prefill, mixed prefill+decode steps and decode-only steps."""
import os

import pytest
import torch

from megainfer import LLM, SamplingParams
from parity_util import hf_greedy

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(),
                                reason="Triton needs a GPU or TRITON_INTERPRET=1")
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@pytest.mark.parametrize("family,shape", [("mixtral", "base"), ("qwen3_moe", "odd")])
def test_triton_engine_matches_hf_greedy(tiny_ckpts, hf_models, family, shape):
    path = tiny_ckpts[(family, shape)]
    # a small token budget: prompts arrive in chunks over a cached prefix, beside decodes
    kw = dict(dtype="float32", device=DEVICE, max_num_batched_tokens=24, max_num_seqs=4,
              max_model_len=128, num_blocks=64, block_size=8, cuda_graphs=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 31, 12, 1)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tri = LLM(path, attention_backend="triton", **kw)
    assert tri.model.attention_backend.name == "triton"
    got = [o.outputs[0].token_ids for o in tri.generate(prompts, sp, use_tqdm=False)]
    ref = [o.outputs[0].token_ids for o in
           LLM(path, attention_backend="torch", **kw).generate(prompts, sp, use_tqdm=False)]
    hf = hf_models((family, shape))
    assert got == ref
    assert got == [hf_greedy(hf, p, 6) for p in prompts]
