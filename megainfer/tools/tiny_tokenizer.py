"""A small real tokenizer for tiny checkpoints: byte-level BPE (GPT-2's alphabet, as Qwen and
DeepSeek use) trained on a few lines of chat, JSON and tool-call text, with a chat style's
special tokens (pad, bos, eos at ids 0, 1, 2: the tiny configs' ids) and its markers
(``<think>``, ``<tool_call>``, DeepSeek-V3's tool tokens) as added tokens that decode to their
text. Written as ``tokenizer.json`` and ``tokenizer_config.json`` (with the style's chat
template) beside the weights."""
from __future__ import annotations

import json
import os

from .chat_styles import STYLES

CORPUS = [
    'The weather in Oslo is cold. {"city": "Oslo", "unit": "celsius", "days": 3}',
    '{"name": "get_weather", "arguments": {"city": "Lima"}} [1, 2, 3] true false null',
    "Let me think about it step by step. First, the answer is 42. Hello! How are you?",
    "```json\n{\"query\": \"tiny models\", \"limit\": 10}\n```\nfunction name arguments",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"()[]{}<>-_=+*/",
]


def write_tokenizer(out: str, style: str, vocab_size: int) -> dict:
    """``tokenizer.json`` + ``tokenizer_config.json`` of ``style`` in ``out``, at most
    ``vocab_size`` ids; returns {"eos_token_id", "bos_token_id", "vocab_size"} used."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    template, special, added = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(added), special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4 + [template], trainer)
    tok.add_tokens(added)  # markers the decoded text keeps (not special)
    assert tok.get_vocab_size() <= vocab_size, (tok.get_vocab_size(), vocab_size)
    tok.save(os.path.join(out, "tokenizer.json"))
    cfg = {"bos_token": special[1], "eos_token": special[2], "pad_token": special[0],
           "chat_template": template, "model_max_length": 4096,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False, indent=1)
    return {"bos_token_id": 1, "eos_token_id": 2, "vocab_size": tok.get_vocab_size()}
