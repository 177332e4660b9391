"""A frontend's side of admission: prompts validated into token ids with the job's tokenizer
and limits, off the engine core's loop, in whichever process the frontend runs (the script's,
in every deploy mode); ``open`` is how every frontend (``LLM``'s ``SyncClient``, ``AsyncLLM``)
turns one request into the core's input and the stream its updates are applied to."""
from __future__ import annotations

from typing import Optional

from megainfer.config import ResolvedJob
from megainfer.engine_core.messages import AddRequest
from megainfer.engine.intake import TokenizedPrompt, tokenize_request
from megainfer.engine.outputs import PromptInput
from megainfer.core_client.request_stream import RequestStream
from megainfer.engine.sampling_params import SamplingParams
from megainfer.engine.tokenizer import Tokenizer, load_tokenizer


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
