"""The offline API: prompt forms, output order, tokenizers, progress bar."""
import shutil

import pytest

from megainfer import LLM, RequestOutput, SamplingParams
from megainfer.config import ModelConfig
from megainfer.engine import RequestError
from megainfer.engine.tokenizer import ByteTokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_ckpts):
    return LLM(tiny_ckpts[("qwen3_moe", "base")], max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=32)


def test_prompt_forms_and_order(llm):
    text = "héllo, wörld ✓"
    ids = list(text.encode())
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}, {"prompt": "abc"}], GREEDY,
                        use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    assert outs[0].prompt == text and outs[0].prompt_token_ids == ids  # byte fallback
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == \
        outs[2].outputs[0].token_ids
    assert outs[3].prompt_token_ids == [97, 98, 99]
    # order: the same prompts reversed come back reversed
    rev = llm.generate([{"prompt": "abc"}, ids], GREEDY, use_tqdm=False)
    assert rev[0].outputs[0].token_ids == outs[3].outputs[0].token_ids
    assert rev[1].outputs[0].token_ids == outs[1].outputs[0].token_ids
    single = llm.generate("abc", GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[3].outputs[0].token_ids
    single_ids = llm.generate([97, 98, 99], GREEDY, use_tqdm=False)
    assert single_ids[0].outputs[0].token_ids == outs[3].outputs[0].token_ids
    o = outs[0]
    assert o.metrics.ttft > 0 and o.metrics.tpot(6) > 0 and o.outputs[0].finish_reason == "length"


def test_per_prompt_params(llm):
    outs = llm.generate(["a", "b"], [GREEDY, SamplingParams(temperature=0, max_tokens=3,
                                                            ignore_eos=True)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 3]
    with pytest.raises(RequestError, match="sampling_params: 3 given for 2 prompts"):
        llm.generate(["a", "b"], [GREEDY] * 3)


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    for s in ["", "plain", "ünïcødé — ✓ 漢字 🙂", "\x00\x7f"]:
        assert tok.decode(tok.encode(s)) == s
    assert ByteTokenizer([2]).decode([104, 2, 105, 300]) == "hi"


def test_tokenizer_json_from_checkpoint(tiny_ckpts, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpts[("mixtral", "base")], d)
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 10, "world": 11, "again": 12}
    vocab.update({f"w{i}": i for i in range(13, 256)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[UNK]", "<s>", "</s>"])
    tok.save(str(d / "tokenizer.json"))
    llm = LLM(str(d), max_model_len=64)
    out = llm.generate("hello world again", GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == [10, 11, 12]
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)
    assert "w" in out.outputs[0].text or out.outputs[0].text == ""  # decoded by the WordLevel vocab


def test_dummy_model_from_config_and_progress_bar(capsys):
    cfg = ModelConfig(family="mixtral", vocab_size=300, hidden_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, num_experts=2, top_k=1,
                      moe_intermediate_size=32, max_position_embeddings=64)
    llm = LLM(cfg, seed=3)
    a = llm.generate(["x", "yy"], GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "tok/s" in err and "2/2" in err
    b = LLM(cfg, seed=3).generate(["x", "yy"], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert llm.engine.max_model_len == 64  # derived from max_position_embeddings
