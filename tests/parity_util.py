"""Greedy parity against a Hugging Face model, on cpu or cuda (wherever the model lives).

``hf_greedy``: HF ``generate``, one prompt at a time (no padding), eos disabled.
``check_greedy_close``: vLLM's logprob-style check for reduced precision, where exact token
equality is too strict: the tokens must equal HF's argmax (teacher-forced on our own tokens)
up to the first divergence, and there ours must be among HF's top k; past it nothing is
compared, since the two sequences then have different contexts.
"""
from __future__ import annotations

import copy

import torch


def _device(hf_model) -> torch.device:
    return next(hf_model.parameters()).device


def hf_greedy(hf_model, prompt_ids: list[int], n: int, **generation) -> list[int]:
    """HF generate, eos disabled like ignore_eos (an eos token is still emitted when it is the
    argmax, unlike with min_new_tokens); ``generation`` overrides generation-config fields
    (``repetition_penalty=``, ``eos_token_id=`` with ``min_new_tokens=``, ...)."""
    gc = copy.deepcopy(hf_model.generation_config)
    # None would fall back to the model default: an id past the vocabulary never matches
    gc.eos_token_id, gc.pad_token_id, gc.do_sample, gc.max_new_tokens = 10**6, 0, False, n
    for k, v in generation.items():
        setattr(gc, k, v)
    ids = torch.tensor([list(prompt_ids)], device=_device(hf_model))
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    if "eos_token_id" not in generation:  # a real eos may end it early
        assert out.shape[1] == len(prompt_ids) + n, out.shape
    return out[0, len(prompt_ids):].tolist()


def check_greedy_close(ours: list[int], hf_model, prompt_ids: list[int], k: int = 5) -> int:
    """One HF forward over prompt + ours; at generated position i, HF's top-k ids given the
    prompt and ours[:i]. Returns the number of leading tokens equal to HF's argmax (len(ours)
    when none diverges). Raises AssertionError when, at the first divergence, ours[i] is not
    in HF's top k."""
    ours, prompt_ids = list(ours), list(prompt_ids)
    assert ours and prompt_ids, "check_greedy_close needs a prompt and at least one token"
    P = len(prompt_ids)
    ids = torch.tensor([prompt_ids + ours], device=_device(hf_model))
    with torch.no_grad():
        logits = hf_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    logits = logits[P - 1:P - 1 + len(ours)].float()  # [n, V]: row i predicts ours[i]
    top = logits.topk(k, dim=-1)
    top_ids = top.indices.tolist()
    for i, tok in enumerate(ours):
        if tok == top_ids[i][0]:
            continue
        if tok in top_ids[i]:
            return i
        row = logits[i]
        rank = int((row > row[tok]).sum())
        raise AssertionError(
            f"greedy diverged from HF at generated position {i} (absolute position {P + i}) "
            f"after {i} matching tokens: ours={tok} (HF logit {row[tok].item():.4f}, rank {rank}) "
            f"is not in HF's top {k} {top_ids[i]} (logits "
            f"{[round(v, 4) for v in top.values[i].tolist()]})")
    return len(ours)
