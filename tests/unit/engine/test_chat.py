"""LLM.chat and the chat template: sources, sandbox, special tokens, errors."""
import json
import shutil

import pytest

from megainfer import LLM, SamplingParams
from megainfer.engine.chat_template import (ChatTemplateError, encode_chat, load_chat_template,
                                            load_special_tokens, render_chat)

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# a Mixtral/Llama-2-like template: BOS written by the template, system folded into the first turn
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %} ASSISTANT:{% endif %}")
CONV = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
TEXT = "<s><<SYS>>be brief<</SYS>>[INST] hi [/INST] ASSISTANT:"


def _ckpt(tiny_ckpts, tmp_path, name, tokenizer_config=None, jinja=None):
    d = tmp_path / name
    shutil.copytree(tiny_ckpts[("mixtral", "base")], d)
    if tokenizer_config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    return str(d)


@pytest.fixture(scope="module")
def chat_llm(tiny_ckpts, tmp_path_factory):
    d = _ckpt(tiny_ckpts, tmp_path_factory.mktemp("chat"), "tc",
              {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}})
    return LLM(d, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)


def test_chat_renders_the_checkpoint_template(chat_llm):
    out = chat_llm.chat(CONV, GREEDY, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt == TEXT
    assert out[0].prompt_token_ids == list(TEXT.encode())  # byte tokenizer: nothing added
    ref = chat_llm.generate(TEXT, GREEDY, use_tqdm=False)[0]
    assert out[0].outputs[0].token_ids == ref.outputs[0].token_ids
    # several conversations: outputs in order; add_generation_prompt=False drops the cue
    two = chat_llm.chat([CONV, [{"role": "user", "content": "yo"}]], GREEDY, use_tqdm=False,
                        add_generation_prompt=False)
    assert [o.prompt for o in two] == [TEXT[:-len(" ASSISTANT:")], "<s>[INST] yo [/INST]"]
    # a template given in the call wins over the checkpoint's
    own = chat_llm.chat(CONV, GREEDY, use_tqdm=False,
                        chat_template="{% for m in messages %}{{ m.content }}|{% endfor %}")
    assert own[0].prompt == "be brief|hi|"


def test_chat_template_file_and_named_templates(tiny_ckpts, tmp_path):
    d = _ckpt(tiny_ckpts, tmp_path, "jinja", {"chat_template": "ignored", "bos_token": "<s>"},
              jinja="{{ bos_token }}{{ messages[-1]['content'] }}")
    assert load_chat_template(d) == "{{ bos_token }}{{ messages[-1]['content'] }}"
    out = LLM(d, max_model_len=64).chat(CONV, GREEDY, use_tqdm=False)
    assert out[0].prompt == "<s>hi"
    d2 = _ckpt(tiny_ckpts, tmp_path, "named", {"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    assert load_chat_template(d2) == "D"
    assert load_special_tokens(d2) == {}


def test_make_tiny_writes_a_template_that_chats(tmp_path, capsys):
    from megainfer.tools.make_tiny import main as make_tiny_main
    make_tiny_main(["--family", "mixtral", "--out", str(tmp_path / "t")])  # template: default on
    assert "with a chat template" in capsys.readouterr().out
    llm = LLM(str(tmp_path / "t"), max_model_len=128)
    out = llm.chat(CONV, GREEDY, use_tqdm=False)
    text = "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert out[0].prompt == text and out[0].prompt_token_ids == list(text.encode())
    assert out[0].outputs[0].token_ids == llm.generate(text, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    make_tiny_main(["--family", "mixtral", "--out", str(tmp_path / "bare"), "--no-chat-template"])
    assert load_chat_template(str(tmp_path / "bare")) is None


def test_missing_template_is_a_typed_error(tiny_ckpts):
    llm = LLM(tiny_ckpts[("mixtral", "base")], max_model_len=64)
    with pytest.raises(ChatTemplateError, match="no chat template") as info:
        llm.chat(CONV, GREEDY, use_tqdm=False)
    assert isinstance(info.value, ValueError)
    assert not llm.engine.has_unfinished()
    assert load_chat_template(None) is None


@pytest.mark.parametrize("template,msg", [
    ("{{ ''.__class__.__mro__ }}", "sandbox"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "sandbox"),
    ("{{ messages.__class__ }}", "sandbox"),
    ("{{ messages[0].content.format.__globals__ }}", "sandbox"),
    ("{% set ns = namespace(_x=1) %}", "sandbox"),
    ("{{ messages.append(1) }}", "sandbox"),  # immutable: no mutation of the caller's data
    ("{% for m in messages %}", "syntax error on line 1"),
    ("{{ raise_exception('bad role') }}", "bad role"),
    ("{{ undefined_fn() }}", "chat template"),
])
def test_sandbox_and_template_failures(template, msg):
    with pytest.raises(ChatTemplateError, match=msg):
        render_chat(template, CONV)


def test_helpers_and_message_checks():
    t = ("{{ strftime_now('%Y') | length }}{% set ns = namespace(n=0) %}{% for m in messages %}"
         "{% set ns.n = ns.n + 1 %}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
         "{{ ns.n }}{{ messages | tojson }}\n  {% if true %}\n x{% endif %}")
    out = render_chat(t, CONV)
    assert out.startswith("42") and '"content": "be brief"' in out
    assert out.endswith(" x")  # trim_blocks / lstrip_blocks as transformers sets them
    assert render_chat("{% generation %}a{% endgeneration %}", CONV) == "a"
    for bad, msg in [([], "non-empty list"), ("hi", "non-empty list"), ([1], r"messages\[0\]"),
                     ([{"content": "x"}], "'role'"), ([{"role": "user"}], "lacks 'content'"),
                     ([{"role": "user", "content": object()}], "not JSON data")]:
        with pytest.raises(ChatTemplateError, match=msg):
            render_chat("x", bad)


def _word_level_ckpt(tiny_ckpts, tmp_path) -> str:
    """The tiny checkpoint with a word-level tokenizer.json: special <s> (1, added as BOS),
    </s> (2), [UNK] (0); words hi (10), [INST] (11), [/INST] (12), ASSISTANT: (13)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    d = _ckpt(tiny_ckpts, tmp_path, "tok", {"chat_template": TEMPLATE, "bos_token": "<s>",
                                            "eos_token": "</s>"})
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hi": 10, "[INST]": 11, "[/INST]": 12,
             "ASSISTANT:": 13}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["[UNK]", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(f"{d}/tokenizer.json")
    return d


def test_skip_special_tokens_false_keeps_their_text_offline_and_streamed(tiny_ckpts, tmp_path):
    """vLLM's ``skip_special_tokens``: by default </s> adds no text; with False it does, in
    ``LLM.generate``, in the streamed text (``AsyncLLM``'s request stream) and for stop strings."""
    d = _word_level_ckpt(tiny_ckpts, tmp_path)
    kw = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={2: 100})
    llm = LLM(d, max_model_len=64)
    plain = llm.generate("hi", SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
    kept = llm.generate("hi", SamplingParams(**kw, skip_special_tokens=False),
                        use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == kept.token_ids == [2, 2, 2]
    assert plain.text == "" and kept.text.split() == ["</s>"] * 3
    stop = llm.generate("hi", SamplingParams(**kw, skip_special_tokens=False, stop=["</s>"]),
                        use_tqdm=False)[0].outputs[0]
    assert stop.stop_reason == "</s>" and stop.token_ids == [2] and stop.text == ""

    # streamed: each iteration's update applied to the request's stream as AsyncLLM does (one
    # update at a time here: AsyncLLM's event loop may take several in one wake-up)
    from megainfer.core_client.request_stream import Intake
    from megainfer.engine.outputs import PromptInput
    from megainfer.engine_core.core import EngineCore
    core = EngineCore(llm.engine)
    add, stream = Intake.of_engine(llm.engine).open(
        PromptInput.of("r", "hi", SamplingParams(**kw, skip_special_tokens=False)))
    texts = []
    for u in core.handle(add):
        stream.apply(u)
    while not stream.finished:
        for u in core.step():
            stream.apply(u)
            texts.append(stream.output().outputs[0].text)
    assert texts[-1] == kept.text and any(t.strip() == "</s>" for t in texts[:-1]), texts


def test_no_second_bos_with_a_tokenizer_json(tiny_ckpts, tmp_path):
    d = _word_level_ckpt(tiny_ckpts, tmp_path)
    llm = LLM(d, max_model_len=64)
    assert llm.get_tokenizer().encode("hi") == [1, 10]  # plain prompts get the BOS
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == [1, 11, 10, 12, 13]  # the template's BOS only
    assert encode_chat(llm.get_tokenizer(), "<s> hi") == [1, 10]


def test_llm_chat_renders_tools_and_template_kwargs(tmp_path):
    """``LLM.chat(tools=..., chat_template_kwargs=...)`` hands both to the template: the
    Qwen3-style template lists the function and closes the think block when asked."""
    from megainfer.tools.make_tiny import make_tiny
    d = make_tiny("qwen3_moe", str(tmp_path / "q3"), seed=2, tokenizer="qwen3", max_pos=256)
    llm = LLM(d, max_model_len=256)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "weather in Oslo?"}]
    p = SamplingParams(temperature=0, max_tokens=2)
    plain = llm.chat(msgs, p, use_tqdm=False)[0].prompt
    with_tools = llm.chat(msgs, p, use_tqdm=False, tools=tools,
                          chat_template_kwargs={"enable_thinking": False})[0].prompt
    assert "get_weather" not in plain and "get_weather" in with_tools
    assert "<think>" not in plain.split("assistant")[-1]
    assert "</think>" in with_tools.split("assistant")[-1], with_tools
