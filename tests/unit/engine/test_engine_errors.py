"""Bad input, table-driven: the typed error and its message, then the engine still serves."""
import pytest

from megainfer import LLM, SamplingParams
from megainfer.config import ConfigError
from megainfer.engine import (CacheTooSmallError, EmptyPromptError, PromptTooLongError,
                              RequestError, SamplingParamsError, TokenIdError)

MAX_LEN = 64


@pytest.fixture(scope="module")
def llm(tiny_ckpts):
    return LLM(tiny_ckpts[("mixtral", "base")], max_model_len=MAX_LEN, block_size=4,
               max_num_seqs=4)


GOOD = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
REQUEST_CASES = [  # (prompt, sampling kwargs, error type, message fragment)
    ("", {}, EmptyPromptError, "prompt=''"),
    ([], {}, EmptyPromptError, "prompt_token_ids=[]"),
    ([5] * (MAX_LEN + 1), {}, PromptTooLongError, f"max_model_len={MAX_LEN}"),
    ([5, -1, 6], {}, TokenIdError, "prompt_token_ids[1]=-1"),
    ([5, 256], {}, TokenIdError, "prompt_token_ids[1]=256: must be an integer in [0, vocab_size=256)"),
    ([5, 2.5], {}, TokenIdError, "prompt_token_ids[1]=2.5"),
    ([5], dict(temperature=-0.5), SamplingParamsError, "temperature=-0.5"),
    ([5], dict(top_p=0.0), SamplingParamsError, "top_p=0.0: must be in (0, 1]"),
    ([5], dict(top_p=1.5), SamplingParamsError, "top_p=1.5"),
    ([5], dict(top_k=-2), SamplingParamsError, "top_k=-2"),
    ([5], dict(top_k=0), SamplingParamsError, "top_k=0"),
    ([5], dict(max_tokens=0), SamplingParamsError, "max_tokens=0"),
    ([5], dict(min_p=2.0), SamplingParamsError, "min_p=2.0"),
    ([5], dict(seed="x"), SamplingParamsError, "seed='x'"),
]


@pytest.mark.parametrize("prompt,kw,err,msg", REQUEST_CASES,
                         ids=[f"{c[2].__name__}-{i}" for i, c in enumerate(REQUEST_CASES)])
def test_bad_request_is_refused_and_engine_keeps_serving(llm, prompt, kw, err, msg):
    ref = llm.generate([[7, 8, 9]], GOOD, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(err) as info:
        llm.generate([[7, 8, 9], prompt], SamplingParams(**{**dict(max_tokens=8), **kw}),
                     use_tqdm=False)
    assert isinstance(info.value, (RequestError, ValueError)) and msg in str(info.value)
    assert not llm.engine.has_unfinished()  # the good request of that call was withdrawn too
    assert llm.generate([[7, 8, 9]], GOOD, use_tqdm=False)[0].outputs[0].token_ids == ref


def test_bad_request_in_a_stream_fails_alone(llm):
    from megainfer.engine import PromptInput
    ins = [PromptInput("a", prompt_token_ids=[7, 8, 9], params=GOOD),
           PromptInput("b", prompt_token_ids=[999], params=GOOD),
           PromptInput("c", prompt="", params=GOOD),
           PromptInput("d", prompt="hi", params=GOOD)]
    outs = {o.request_id: o for o in llm.generate_stream(ins)}
    assert outs["b"].outputs[0].finish_reason == "error" and "TokenIdError" in outs["b"].error
    assert "prompt=''" in outs["c"].error
    assert len(outs["a"].outputs[0].token_ids) == 8 and outs["a"].error is None
    assert len(outs["d"].outputs[0].token_ids) == 8


STARTUP_CASES = [  # (LLM kwargs, error type, message fragment)
    (dict(max_model_len=64, block_size=4, num_blocks=15), CacheTooSmallError,
     "cache.num_blocks=15: a request of max_model_len=64 tokens needs 16 blocks"),
    (dict(max_model_len=64, kv_cache_memory_gib=1e-6), CacheTooSmallError, "cache.memory_gib"),
    (dict(max_model_len=10**6), ConfigError, "scheduler.max_model_len=1000000"),
    (dict(max_num_seqs=0), ConfigError, "scheduler.max_num_seqs=0"),
    (dict(enable_chunked_prefill=False, max_model_len=128, max_num_batched_tokens=64), ConfigError,
     "scheduler.max_num_batched_tokens=64"),
]


@pytest.mark.parametrize("kw,err,msg", STARTUP_CASES)
def test_bad_startup_config_refused(tiny_ckpts, kw, err, msg):
    with pytest.raises(err, match=msg.replace("(", r"\(").replace("[", r"\[")):
        LLM(tiny_ckpts[("mixtral", "base")], **kw)


def test_duplicate_request_id(llm):
    from megainfer.engine import DuplicateRequestError
    llm.engine.add_request("dup", [5], GOOD)
    with pytest.raises(DuplicateRequestError, match="request_id='dup'"):
        llm.engine.add_request("dup", [6], GOOD)
    assert llm.engine.abort_request("dup").outputs[0].finish_reason == "abort"
    assert not llm.engine.has_unfinished()
