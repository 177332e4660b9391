"""megainfer: attention-expert disaggregated MoE inference (MegaScale-Infer design)."""
from megainfer.engine import CompletionOutput, RequestOutput, SamplingParams
from megainfer.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
