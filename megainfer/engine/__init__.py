"""The engine every attention replica runs: requests, scheduler, paged KV cache, sampler."""
from .engine import LLMEngine
from .sizing import check_cache_fits
from .errors import (CacheTooSmallError, DuplicateRequestError, EmptyPromptError,
                     PromptTooLongError, RequestError, SamplingParamsError, TokenIdError)
from .outputs import (CompletionOutput, PromptInput, RequestMetrics, RequestOutput, SampleDelta,
                      StepOutputs)
from .sampling_params import SamplingParams
from .structured_outputs import StructuredOutputsParams
from .step import LocalExecutor, ModelExecutor, StepInput

__all__ = ["LLMEngine", "check_cache_fits", "CacheTooSmallError", "DuplicateRequestError",
           "EmptyPromptError", "PromptTooLongError", "RequestError", "SamplingParamsError",
           "TokenIdError", "CompletionOutput", "PromptInput", "RequestMetrics", "RequestOutput",
           "SampleDelta", "StepOutputs",
           "SamplingParams", "StructuredOutputsParams", "LocalExecutor", "ModelExecutor", "StepInput"]
