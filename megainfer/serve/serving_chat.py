"""``POST /v1/chat/completions``: the messages rendered with the chat template (off the event
loop when long), the request admitted by its cost, the answer whole or streamed."""
from __future__ import annotations

import dataclasses
import uuid

from fastapi import Request

from megainfer.config import ServeConfig

from . import responses as R
from .chat import ChatPrompts
from .chat_message import MessageReader, finish_reason
from .served_engine import ServedEngine
from .errors import APIError
from .protocol import ChatCompletionRequest
from .serving_base import Serving, finals, unless_disconnected
from .reasoning import END as THINK_END, think_open
from .response_format import structured_spec
from .tools import tool_plan


def _chars(messages) -> int:
    return sum(len(m.content) if isinstance(m.content, str) else
               sum(len(p.text) for p in m.content or ()) for m in messages)


class ChatServing(Serving):
    def __init__(self, client: ServedEngine, cfg: ServeConfig, chat: ChatPrompts):
        super().__init__(client, cfg)
        self.chat = chat

    async def render(self, messages, add_generation_prompt: bool, tools=None,
                     template_kwargs=None) -> tuple[str, list[int]]:
        """The messages' prompt text and token ids (a 400 naming ``messages``)."""
        if not self.chat.available:
            raise APIError("this model has no chat template (start the server with "
                           "serve.chat_template=...)", 400, "messages")
        return await self.client.off_loop(_chars(messages), self.chat.render, messages,
                                          add_generation_prompt, tools, template_kwargs)

    async def create(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        plan = tool_plan(body.tools, body.tool_choice, self.cfg, body.parallel_tool_calls)
        if plan.grammar is not None and (body.response_format is not None and
                                         body.response_format.type != "text"
                                         or body.structured_outputs is not None):
            raise APIError("tool_choice: a forced call cannot also follow response_format or "
                           "structured_outputs", 400, "tool_choice")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs: needs logprobs=true", 400, "top_logprobs")
        self.check_samples(body.n)
        c = self.client
        tools = [t.model_dump(exclude_none=True) for t in body.tools] \
            if body.tools and body.tool_choice != "none" else None
        text, ids = await self.render(body.messages, body.add_generation_prompt, tools,
                                      body.chat_template_kwargs)
        thinking = self.cfg.reasoning_parser is not None and think_open(text)
        reader = MessageReader(self.cfg.reasoning_parser if thinking else None, plan)
        grammar = plan.grammar or structured_spec(body.response_format, body.structured_outputs)
        if grammar is not None and thinking and "start_after" not in (body.structured_outputs
                                                                        or {}):
            grammar = dataclasses.replace(grammar, start_after=THINK_END)  # the answer's
        top = (body.top_logprobs or 0) if body.logprobs else None
        check = body.sampling_params(c.max_model_len, None, grammar=grammar)
        await c.compile_grammar(check, "tool_choice" if plan.grammar is not None
                                else body.grammar_field())
        ids = await c.prompt_ids(ids, check, "messages")
        field = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        params = body.sampling_params(c.token_budget(ids, body.token_budget(), field), top,
                                      body.prompt_logprobs, grammar=grammar)
        rid = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        admission = c.admit(body.n, len(ids), [rid])
        try:
            stream = c.generate(ids, params, rid, admission)
            if body.stream:
                so = body.stream_options
                return self.stream_response(R.chat_events(
                    R.merged([stream]), rid, self.name, body.n, top, reader,
                    bool(so and so.include_usage), bool(so and so.continuous_usage_stats)),
                    admission)
            out = (await unless_disconnected(request, finals([stream])))[0]
            self.cut_short([rid])
        finally:
            if not body.stream:
                admission.release()
        choices = []
        for o in out.outputs:
            msg = reader.whole(o.text)
            choices.append(R.chat_choice(o.index, o, None if top is None else
                                         R.chat_logprobs(o.logprobs or [], o.token_ids, top),
                                         msg, finish_reason(o.finish_reason,
                                                            "tool_calls" in msg)))
        res = R.envelope(rid, "chat.completion", self.name, R.now(), choices,
                         R.usage(*R.tokens_of([out])))
        if body.prompt_logprobs is not None:  # vLLM's field, beside the choices
            res["prompt_logprobs"] = R.prompt_logprobs(out.prompt_logprobs, ids,
                                                       body.prompt_logprobs)
        return res
