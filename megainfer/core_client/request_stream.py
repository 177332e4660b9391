"""One request's stream of outputs in the frontend: the engine core's updates in, cumulative
``RequestOutput``s out (vLLM's default ``output_kind``), text decoded here, off the core's loop.

Mid-stream outputs carry every token so far and the text of the complete characters so far
(``SampleText``: a UTF-8 character split over tokens appears whole, in one output; with stop
strings the last ``len(longest) - 1`` characters are held back). The last output is the core's
final ``RequestOutput`` with its text filled in exactly as ``LLM.generate`` gives it: the stop
string's cut text from the core, else the whole output decoded at once.
"""
from __future__ import annotations

from typing import Any, Optional

from megainfer.engine.detokenizer import SampleText, decode_text
from megainfer.engine.intake import TokenizedPrompt
from megainfer.engine.outputs import CompletionOutput, RequestOutput
from megainfer.engine.sampling_params import SamplingParams
from megainfer.engine_core.messages import RequestUpdate


class RequestStream:
    def __init__(self, request_id: Any, prompt: TokenizedPrompt, params: SamplingParams,
                 tokenizer):
        self.request_id, self.prompt, self.tokenizer = request_id, prompt, tokenizer
        self.skip_special = params.skip_special_tokens
        self.samples = [SampleText(tokenizer, params.stop, self.skip_special)
                        for _ in range(params.n)]
        want_lp = params.logprobs is not None
        self.logprobs: list[Optional[list]] = [[] if want_lp else None for _ in self.samples]
        self.cumulative = [0.0] * params.n
        self.finish: list[Optional[str]] = [None] * params.n
        self.stop: list = [None] * params.n
        self.final: Optional[RequestOutput] = None
        self.num_new = 0  # tokens applied since the last output was taken

    @property
    def finished(self) -> bool:
        return self.final is not None

    def apply(self, update: RequestUpdate) -> bool:
        """Take one update; True when there is something new to output."""
        for d in update.new_tokens:
            self.samples[d.index].add(d.token_ids)
            if d.logprobs is not None and self.logprobs[d.index] is not None:
                self.logprobs[d.index] += d.logprobs
                self.cumulative[d.index] += sum(lp[t].logprob for lp, t in
                                                zip(d.logprobs, d.token_ids))
            self.finish[d.index], self.stop[d.index] = d.finish_reason, d.stop_reason
            self.num_new += len(d.token_ids)
        if update.output is not None:
            self.final = self._complete(update.output)
        return bool(update.new_tokens) or update.output is not None

    def output(self) -> RequestOutput:
        """The cumulative output now (the final one once finished)."""
        self.num_new = 0
        if self.final is not None:
            return self.final
        outs = [CompletionOutput(
            i, s.visible(), list(s.token_ids), self.finish[i],
            None if self.logprobs[i] is None else list(self.logprobs[i]),
            None if self.logprobs[i] is None else self.cumulative[i], self.stop[i])
            for i, s in enumerate(self.samples)]
        return RequestOutput(self.request_id, self.prompt.prompt,
                             self.prompt.prompt_token_ids, outs, False)

    def _complete(self, out: RequestOutput) -> RequestOutput:
        for c in out.outputs:
            if not isinstance(c.stop_reason, str) and c.finish_reason != "error":
                c.text = decode_text(self.tokenizer, c.token_ids, self.skip_special)  # as
                # request_output decodes
        out.request_id = self.request_id
        if out.prompt is None:  # the runtime's replicas get token ids; the text stayed here
            out.prompt = self.prompt.prompt
        return out
