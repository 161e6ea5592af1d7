"""vLLM's ``/tokenize`` and ``/detokenize``: the prompt the server would run, counted as the
generation routes encode and render it, bounded by the context as every prompt is.

Tokenising runs on the tokenizer thread (:meth:`.state.ServerState.off_loop`), never on the
event loop, so one huge prompt cannot stall the other requests.
"""

from __future__ import annotations

from fastapi import Depends

from ..engine.llm_engine import LLMEngine
from .chat import chat_tokens
from .errors import ApiError
from .limits import check_context, check_in_vocabulary
from .protocol import DetokenizeRequest, TokenizeRequest
from .state import ServerState, get_state

def _tokenizing_engine(state: ServerState, model: str | None) -> tuple[LLMEngine, str | None]:
    """The engine (and adapter) a tokenize request names; the first base when it names none."""
    if model is None:
        return next(iter(state.colocation.engines.values())), None
    _, engine, adapter = state.resolve(model)
    return engine, adapter


async def tokenize(req: TokenizeRequest, state: ServerState = Depends(get_state)) -> dict:
    """A ``prompt`` as ``/v1/completions`` encodes it, or ``messages`` as the chat renders them."""
    engine, adapter = _tokenizing_engine(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give either prompt or messages", param="prompt")
    if req.messages is None:
        special = req.add_special_tokens
        tokens = await state.off_loop(lambda: engine.tokenizer.encode(req.prompt, add_special_tokens=special))
    else:
        tokens = await chat_tokens(state, engine, req.messages, adapter)
    check_context(engine, len(tokens), "prompt" if req.messages is None else "messages")
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": list(tokens)}


async def detokenize(req: DetokenizeRequest, state: ServerState = Depends(get_state)) -> dict:
    """Token ids -> text, for ids the vocabulary has and no more than the context holds."""
    engine, _ = _tokenizing_engine(state, req.model)
    check_context(engine, len(req.tokens), "tokens")  # before any id is read or decoded
    check_in_vocabulary(req.tokens, engine.vocab_size, "tokens")
    return {"prompt": await state.off_loop(engine.tokenizer.decode, req.tokens)}
