"""kvshare.serve: the serving engine with one paged KV pool shared by base and adapters.

The engine's names load on first use (PEP 562), so importing a light part of the package,
such as the vLLM plugin inside vLLM's processes, does not import the engine.
"""

from __future__ import annotations

import importlib

_LAZY = {"LLM": ".engine.llm_engine", "LLMEngine": ".engine.llm_engine", "RequestOutput": ".engine.llm_engine",
         "SamplingParams": ".sampling_params"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
