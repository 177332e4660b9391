"""One request in the frontend, both ways: ``Intake.open`` validates its prompt into token ids
with the job's tokenizer and limits (off the engine core's loop, in the frontend's process, every
deploy mode) and gives the core's ``AddRequest``; its ``RequestStream`` turns the core's updates
into cumulative ``RequestOutput``s (vLLM's default ``output_kind``), text decoded here.

Mid-stream outputs carry every token so far and the text of the complete characters so far
(``SampleText``: a UTF-8 character split over tokens appears whole, in one output; with stop
strings the last ``len(longest) - 1`` characters are held back). The last output is the core's
final ``RequestOutput`` with its text filled in exactly as ``LLM.generate`` gives it: the stop
string's cut text from the core, else the whole output decoded at once.
"""
from __future__ import annotations

from typing import Any, Optional

from megainfer.config import ResolvedJob
from megainfer.engine.detokenizer import SampleText, decode_text
from megainfer.engine.intake import TokenizedPrompt, tokenize_request
from megainfer.engine.outputs import CompletionOutput, PromptInput, RequestOutput
from megainfer.engine.sampling_params import SamplingParams
from megainfer.engine.tokenizer import Tokenizer, load_tokenizer
from megainfer.engine_core.messages import AddRequest, RequestUpdate


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


class Intake:
    """``tokenize`` as ``LLMEngine.tokenize`` does it, without an engine."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len

    @classmethod
    def for_job(cls, job: ResolvedJob, tokenizer: Optional[Tokenizer] = None) -> "Intake":
        tok = tokenizer or load_tokenizer(job.load.path, job.model.eos_token_id)
        return cls(tok, job.model.vocab_size, job.scheduler.max_model_len)

    @classmethod
    def of_engine(cls, engine) -> "Intake":
        """The intake of an engine in this process (its tokenizer and limits)."""
        return cls(engine.tokenizer, engine.vocab_size, engine.max_model_len)

    def tokenize(self, prompt, params: SamplingParams, prompt_token_ids=None) -> TokenizedPrompt:
        """A ``RequestError`` names the culprit; nothing is sent to the core."""
        return tokenize_request(self.tokenizer, prompt, prompt_token_ids, params,
                                self.vocab_size, self.max_model_len)

    def open(self, inp: PromptInput) -> tuple[AddRequest, RequestStream]:
        """One request -> (the core's input, the stream of its outputs, text decoded here); a
        ``RequestError`` names the culprit and nothing is sent."""
        tokens = self.tokenize(inp.prompt, inp.params, inp.prompt_token_ids)
        return (AddRequest(str(inp.request_id), tokens, inp.params),
                RequestStream(inp.request_id, tokens, inp.params, self.tokenizer))
