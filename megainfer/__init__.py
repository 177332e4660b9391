"""megainfer: attention-expert disaggregated MoE inference (MegaScale-Infer design)."""
from megainfer.engine import (CompletionOutput, RequestOutput, SamplingParams,
                              StructuredOutputsParams)
from megainfer.llm import LLM
from megainfer.async_llm import AsyncLLM  # noqa: E402 (after LLM: it builds one)

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
