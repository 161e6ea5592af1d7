"""A request's fields -> what the engine runs: :class:`~kvshare.serve.sampling_params.SamplingParams`
(one per choice), the prompt as truncated, and the agent hints."""

from __future__ import annotations

from dataclasses import replace

from fastapi import Request

from ...errors import KvshareError
from ..engine.llm_engine import LLMEngine
from ..hints import AgentHints
from ..sampling_params import SamplingParams
from .errors import ApiError
from .protocol import OpenAIRequest

# the sampling a request may leave out, with its value when the model ships none (off)
_SHIPPED = (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0))


def sampling_params(req: OpenAIRequest, engine: LLMEngine, generation_config: str, max_tokens: int,
                    logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's sampling; what it leaves out comes from the model's generation config
    (unless ``--generation-config vllm``), else is off, as in vLLM."""
    req.check_neutral()
    shipped = engine.sampling_defaults if generation_config == "auto" else {}
    chosen = {name: getattr(req, name) if getattr(req, name) is not None else shipped.get(name, neutral)
              for name, neutral in _SHIPPED}
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=chosen["temperature"], top_p=chosen["top_p"],
                              top_k=max(0, min(chosen["top_k"], engine.vocab_size)), min_p=chosen["min_p"],
                              repetition_penalty=chosen["repetition_penalty"], cache_salt=req.cache_salt,
                              ignore_eos=req.ignore_eos, stop_token_ids=list(req.stop_token_ids or []),
                              seed=req.seed, stop=[req.stop] if isinstance(req.stop, str) else (req.stop or []),
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              min_tokens=req.min_tokens, allowed_token_ids=req.allowed_token_ids,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    except KvshareError as err:
        raise ApiError(400, str(err)) from None


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Each of ``n`` choices' params: with a seed, choice i draws with seed + i (as vLLM),
    so the choices differ and the whole reply repeats; choice 0 is the n=1 reply."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=(params.seed + i + 2 ** 63) % 2 ** 64 - 2 ** 63) for i in range(n)]


def truncated(req: OpenAIRequest, engine: LLMEngine, tokens: list[int]) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens (-1: the context length)."""
    keep = req.truncate_prompt_tokens
    if keep is None:
        return tokens
    keep = engine.max_model_len if keep == -1 else keep
    if keep > engine.max_model_len:
        raise ApiError(400, f"truncate_prompt_tokens ({keep}) exceeds the maximum context length "
                       f"{engine.max_model_len}", param="truncate_prompt_tokens")
    return tokens[len(tokens) - keep:] if 0 < keep < len(tokens) else tokens


def hints_of(req: OpenAIRequest, request: Request) -> AgentHints:
    """The request's agent hints: the ``kvshare_hints`` body field, ids also from router headers."""
    try:
        return AgentHints.parse(req.kvshare_hints, dict(request.headers))
    except KvshareError as err:
        raise ApiError(400, str(err), param="kvshare_hints") from None
