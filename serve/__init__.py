"""kvshare.serve: the serving engine with one paged KV pool shared by base and adapters."""

from .engine.llm_engine import LLM, LLMEngine, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
