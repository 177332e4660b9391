"""The served model and its tokenizer: ``GET /v1/models`` and ``/v1/models/{id}`` (OpenAI's),
``POST /tokenize`` and ``/detokenize`` (vLLM's). A text or messages to tokenise is bounded as a
prompt is (``max_model_len``, tokenised off the event loop when long)."""
from __future__ import annotations

from typing import Optional

from . import responses as R
from .errors import APIError
from .protocol import DetokenizeRequest, TokenizeRequest
from .serving_base import Serving
from .serving_chat import ChatServing


class TokenServing(Serving):
    def __init__(self, chat: ChatServing, model_dir: Optional[str]):
        super().__init__(chat.client, chat.cfg)
        self.chat, self.model_dir = chat, model_dir

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": R.now(), "owned_by": "megainfer",
                "root": self.model_dir or self.name, "parent": None,
                "max_model_len": self.client.max_model_len}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model(self, model_id: str) -> dict:
        self.check_model(model_id)
        return self.model_card()

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", 400, "prompt")
        c = self.client
        check = c.check_params()
        if body.messages is not None:
            ids = await self.chat.render(body.messages, body.add_generation_prompt)
            ids = await c.prompt_ids(ids, check, "messages")
        else:
            ids = await c.prompt_ids(body.prompt, check)
        return {"tokens": ids, "count": len(ids), "max_model_len": c.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        V, n = self.client.vocab_size, len(body.tokens)
        if n > self.client.max_model_len:
            raise APIError(f"tokens: {n} ids, more than max_model_len="
                           f"{self.client.max_model_len}", 400, "tokens")
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < V), None)
        if bad is not None:
            raise APIError(f"tokens[{bad}]={body.tokens[bad]}: must be in [0, vocab_size={V})",
                           400, "tokens")
        return {"prompt": self.client.tokenizer.decode(body.tokens)}
