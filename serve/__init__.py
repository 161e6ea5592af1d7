"""kvshare.serve: the serving engine with one paged KV pool shared by base and adapters."""

from .engine import LLM, LLMEngine, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
