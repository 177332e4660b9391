"""Chat requests -> prompt token ids: the checkpoint's chat template (or the operator's
``serve.chat_template``) rendered in the engine's sandbox (engine/chat_template.py). A request
gives messages only: no template, no path, no code."""
from __future__ import annotations

import os
from typing import Optional

from megainfer.engine.chat_template import ChatRenderer, ChatTemplateError, encode_chat

from .errors import APIError


def operator_template(value: Optional[str]) -> Optional[str]:
    """``serve.chat_template``: a file the operator names, else the template text itself."""
    if value is None:
        return None
    path = os.path.expanduser(value)
    if "\n" not in value and "{" not in value and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return value


class ChatPrompts:
    def __init__(self, model_dir: Optional[str], tokenizer, chat_template: Optional[str] = None):
        self.renderer = ChatRenderer(model_dir, operator_template(chat_template))
        self.tokenizer = tokenizer

    @property
    def available(self) -> bool:
        return self.renderer.template is not None

    def render(self, messages, add_generation_prompt: bool = True, tools=None,
               template_kwargs=None) -> tuple[str, list[int]]:
        """(rendered text, its token ids); a template failure is a 400 naming ``messages``.
        ``tools``: the request's (as OpenAI's JSON), the template's ``tools`` variable;
        ``template_kwargs``: more variables (vLLM's ``chat_template_kwargs``)."""
        variables = dict(template_kwargs or {})
        taken = sorted(set(variables) & {"messages", "add_generation_prompt", "tools"})
        if taken:
            raise APIError(f"chat_template_kwargs.{taken[0]}: set by the request itself", 400,
                           "chat_template_kwargs")
        if tools:
            variables["tools"] = tools
        try:
            text = self.renderer.render([m.plain() for m in messages], add_generation_prompt,
                                        **variables)
        except ChatTemplateError as e:
            raise APIError(str(e), 400, "messages") from e
        return text, encode_chat(self.tokenizer, text)
