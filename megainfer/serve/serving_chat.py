"""``POST /v1/chat/completions``: the messages rendered with the chat template (off the event
loop when long), the request admitted by its cost, the answer whole or streamed."""
from __future__ import annotations

import uuid

from fastapi import Request

from megainfer.config import ServeConfig

from . import responses as R
from .chat import ChatPrompts
from .engine_client import EngineClient
from .errors import APIError
from .protocol import ChatCompletionRequest
from .serving_base import Serving, finals, unless_disconnected
from .streaming import chat_events, merged


def _chars(messages) -> int:
    return sum(len(m.content) if isinstance(m.content, str) else
               sum(len(p.text) for p in m.content or ()) for m in messages)


class ChatServing(Serving):
    def __init__(self, client: EngineClient, cfg: ServeConfig, chat: ChatPrompts):
        super().__init__(client, cfg)
        self.chat = chat

    async def render(self, messages, add_generation_prompt: bool) -> list[int]:
        """The messages' prompt token ids (a 400 naming ``messages``)."""
        if not self.chat.available:
            raise APIError("this model has no chat template (start the server with "
                           "serve.chat_template=...)", 400, "messages")
        _, ids = await self.client.off_loop(_chars(messages), self.chat.render, messages,
                                            add_generation_prompt)
        return ids

    async def create(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        if body.tools:
            raise APIError("tools: tool calling is not supported", 400, "tools")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs: needs logprobs=true", 400, "top_logprobs")
        self.check_samples(body.n)
        c = self.client
        ids = await self.render(body.messages, body.add_generation_prompt)
        top = (body.top_logprobs or 0) if body.logprobs else None
        check = body.sampling_params(c.max_model_len, None)
        await c.compile_grammar(check, body.grammar_field())
        ids = await c.prompt_ids(ids, check, "messages")
        field = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        params = body.sampling_params(c.token_budget(ids, body.token_budget(), field), top,
                                      body.prompt_logprobs)
        rid = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        admission = c.admit(body.n, len(ids), [rid])
        try:
            stream = c.generate(ids, params, rid, admission)
            if body.stream:
                so = body.stream_options
                return self.stream_response(chat_events(
                    merged([stream]), rid, self.name, body.n, top,
                    bool(so and so.include_usage), bool(so and so.continuous_usage_stats)),
                    admission)
            out = (await unless_disconnected(request, finals([stream])))[0]
            self.cut_short([rid])
        finally:
            if not body.stream:
                admission.release()
        choices = [R.chat_choice(o.index, o, None if top is None else
                                 R.chat_logprobs(o.logprobs or [], o.token_ids, top))
                   for o in out.outputs]
        res = R.envelope(rid, "chat.completion", self.name, R.now(), choices,
                         R.usage(*R.tokens_of([out])))
        if body.prompt_logprobs is not None:  # vLLM's field, beside the choices
            res["prompt_logprobs"] = R.prompt_logprobs(out.prompt_logprobs, ids,
                                                       body.prompt_logprobs)
        return res
