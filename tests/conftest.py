"""Test session set-up. TRITON_INTERPRET must be set before any @triton.jit is defined."""
import os
import sys

# The helpers (mpi_util, parity_util, perfmodel_helpers, tp_threads, ...) sit here, the tests in
# folders below (unit/<package>/, parity/, distributed/, gpu/). Test files import each other's
# helpers by basename (basenames are unique across the folders), so every folder goes on the path.
TESTS = os.path.dirname(os.path.abspath(__file__))
for _dir, _, _ in sorted(os.walk(TESTS), reverse=True):  # TESTS itself ends up first
    if "mpi_progs" not in _dir and "__pycache__" not in _dir and _dir not in sys.path:
        sys.path.insert(0, _dir)
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from repo_paths import MPI_PROGS  # noqa: E402

torch.set_num_threads(1)  # the suite shares 2 cores with its own mpiexec ranks


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one); "
                            "perf/gpu_session.sh runs them with -m gpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
# Two shapes per family: a regular one, and an odd one (6 experts, top-3, one KV head; Qwen
# families also get a dense layer through mlp_only_layers).
SHAPES = {
    "base": dict(layers=2, experts=4, top_k=2, kv_heads=2),
    "odd": dict(layers=3, experts=6, top_k=3, kv_heads=1, heads=4, hidden=48, inter=40),
}


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory):
    """{(family, shape): checkpoint dir}, built once per test session (without a chat template:
    the chat tests add their own)."""
    from megainfer.tools.make_tiny import make_tiny
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for fam in FAMILIES:
        for shape, kw in SHAPES.items():
            kw = dict(kw)
            if shape == "odd" and fam != "mixtral":
                kw["mlp_only_layers"] = (1,)
            if shape == "odd" and fam == "qwen3_moe":
                kw["norm_topk_prob"] = False
            out[(fam, shape)] = make_tiny(fam, str(root / f"{fam}_{shape}"), seed=1,
                                          chat_template=False, **kw)
    return out


@pytest.fixture(scope="session")
def hf_models(tiny_ckpts):
    """Hugging Face transformers models (the oracle) for each tiny checkpoint, loaded lazily."""
    cache = {}

    def get(key):
        if key not in cache:
            import transformers
            cache[key] = transformers.AutoModelForCausalLM.from_pretrained(tiny_ckpts[key]).eval()
        return cache[key]
    return get


@pytest.fixture(scope="session")
def single_mode_tokens(tiny_ckpts):
    """{ckpt: {request id: tokens}} from deploy.mode=single, in process."""
    sys.path.insert(0, MPI_PROGS)
    from runtime_job import CACHE, SCHED, inputs

    from megainfer.config import LoadConfig, ModelConfig
    from megainfer.engine.engine import LLMEngine
    from megainfer.models import build_model
    out = {}
    for fam in FAMILIES:
        path = tiny_ckpts[(fam, "base")]
        cfg = ModelConfig.from_pretrained(path)
        engine = LLMEngine.from_model(build_model(cfg, LoadConfig(path=path)), SCHED, CACHE)
        out[path] = {o.request_id: o.outputs[0].token_ids
                     for o in engine.generate_stream(inputs(cfg.vocab_size, 12))}
    return out
