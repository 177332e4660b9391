"""``POST /v1/completions``: each prompt of a body (text or token ids) checked and tokenised,
the request admitted by its cost (sequences, prompt tokens), its prompts run concurrently, the
answer whole or streamed. ``echo`` puts the prompt before the text (and its logprobs first);
with ``max_tokens=0`` nothing is generated (the engine runs only for the prompt's logprobs)."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator, Optional

from fastapi import Request

from megainfer.engine import RequestOutput
from megainfer.engine.outputs import CompletionOutput

from . import responses as R
from .errors import APIError
from .protocol import CompletionRequest
from .serving_base import Serving, finals, unless_disconnected


@dataclass
class _Prompt:
    ids: list[int]
    params: object  # SamplingParams
    echo: Optional[str]  # the prompt's text when echoed


class CompletionServing(Serving):
    async def create(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        if body.suffix:
            raise APIError("suffix: not supported", 400, "suffix")
        self.check_samples(body.n, body.best_of)
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(f"best_of={body.best_of}: only best_of == n is served", 400,
                           "best_of")
        echo_only = body.echo and body.max_tokens == 0
        prompts = body.prompts()
        self.client.check_size(len(prompts) * body.n)  # before any prompt is tokenised
        check = body.sampling_params(self.client.max_model_len, None)  # a prompt's checks
        await self.client.compile_grammar(check, body.grammar_field())
        echo_lp = body.logprobs if body.echo else None
        asked = [k for k in (echo_lp, body.prompt_logprobs) if k is not None]
        prompt_k = max(asked) if asked else None  # the engine's prompt logprobs serve both
        work = [await self._prompt(p, body, check, prompt_k, echo_only) for p in prompts]
        rid = body.request_id or f"cmpl-{uuid.uuid4().hex}"
        rids = [f"{rid}-{i}" for i in range(len(work))]
        admission = self.client.admit(len(work) * body.n, sum(len(w.ids) for w in work), rids)
        try:
            streams = [self._stream(w, r, admission, echo_only, body.n)
                       for w, r in zip(work, rids)]
            if body.stream:
                so = body.stream_options
                return self.stream_response(R.completion_events(
                    R.merged(streams), rid, self.name, body.n,
                    [w.echo for w in work] if body.echo else None, body.logprobs,
                    bool(so and so.include_usage), bool(so and so.continuous_usage_stats)),
                    admission)
            outs = await unless_disconnected(request, finals(streams))
            self.cut_short(rids)
        finally:
            if not body.stream:
                admission.release()
        return self._response(body, rid, work, [outs[i] for i in range(len(work))])

    async def _prompt(self, prompt, body: CompletionRequest, check, prompt_k: Optional[int],
                      echo_only: bool) -> _Prompt:
        c = self.client
        ids = await c.prompt_ids(prompt, check)
        budget = 1 if echo_only else c.token_budget(ids, body.max_tokens, "max_tokens")
        params = body.sampling_params(budget, body.logprobs, prompt_k, 0 if echo_only else None)
        echo = (prompt if isinstance(prompt, str) else c.tokenizer.decode(ids)) \
            if body.echo else None
        return _Prompt(ids, params, echo)

    def _stream(self, w: _Prompt, rid: str, admission, echo_only: bool, n: int
                ) -> AsyncIterator[RequestOutput]:
        if not echo_only:
            return self.client.generate(w.ids, w.params, rid, admission)
        if w.params.prompt_logprobs is None:  # nothing to compute: the prompt alone
            return _nothing_generated(w.ids, n)
        return _prompt_only(self.client.generate(w.ids, w.params, rid, admission))

    def _response(self, body: CompletionRequest, rid: str, work: list[_Prompt],
                  outs: list[RequestOutput]) -> dict:
        decode = self.client.tokenizer.decode
        choices = []
        for i, (w, out) in enumerate(zip(work, outs)):
            for c in out.outputs:
                lp = None
                if body.logprobs is not None:
                    lp = R.completion_logprobs(c.logprobs or [], c.token_ids, body.logprobs,
                                               len(w.echo or ""))
                    if body.echo:
                        lp = R.merge_logprobs(R.completion_logprobs(
                            out.prompt_logprobs or [None] * len(w.ids), w.ids, body.logprobs,
                            decode=decode), lp)
                plp = None if body.prompt_logprobs is None else R.prompt_logprobs(
                    out.prompt_logprobs, w.ids, body.prompt_logprobs)
                choices.append(R.completion_choice(i * body.n + c.index, c,
                                                   (w.echo or "") + c.text, lp, plp))
        return R.envelope(rid, "text_completion", self.name, R.now(), choices,
                          R.usage(*R.tokens_of(outs)))


def _generated_nothing(out: RequestOutput) -> RequestOutput:
    """``out`` with its samples' tokens dropped (``echo`` with ``max_tokens=0``)."""
    outs = [CompletionOutput(c.index, "", [], "length", None if c.logprobs is None else [],
                             None if c.logprobs is None else 0.0) for c in out.outputs]
    return replace(out, outputs=outs)


async def _prompt_only(stream) -> AsyncIterator[RequestOutput]:
    async for out in stream:
        if out.finished:
            yield _generated_nothing(out)


async def _nothing_generated(ids: list[int], n: int) -> AsyncIterator[RequestOutput]:
    yield RequestOutput(None, None, ids, [CompletionOutput(i, "", [], "length")
                                          for i in range(n)], True)
