"""What the completion and chat replies share: their ids, OpenAI's usage block, and the JSON
encoding of a finished reply, off the event loop and in pieces.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response

from ..engine.llm_engine import RequestOutput

if TYPE_CHECKING:
    from .state import ServerState

_PIECE = 4096  # leaves (numbers, strings) per json.dumps call: about a millisecond of holding the GIL
_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # Starlette's


def json_bytes(value) -> bytes:
    """``value`` as JSONResponse writes it, encoded in pieces (:func:`_json_pieces`): one
    ``json.dumps`` holds the GIL until it returns, so over a reply of a million logprobs it
    stalled the event loop for seconds even from another thread."""
    return "".join(_json_pieces(value)).encode("utf-8")


def _json_pieces(value) -> Iterator[str]:
    """JSON text of ``value`` in pieces of about ``_PIECE`` leaves, between which the thread
    lets the event loop run: containers of containers are taken apart, long lists sliced."""
    if isinstance(value, dict) and not _flat(value):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + _dumps(str(key)) + ":"
            yield from _json_pieces(item)
        yield "}"
    elif isinstance(value, list) and not _flat(value):
        yield "["
        for i, run in enumerate(_runs(value)):
            yield "," if i else ""
            yield from _json_pieces(run[0]) if len(run) == 1 else (_dumps(run)[1:-1],)
        yield "]"
    elif isinstance(value, list) and len(value) > _PIECE:
        yield "[" + ",".join(_dumps(value[i:i + _PIECE])[1:-1] for i in range(0, len(value), _PIECE)) + "]"
    else:
        yield _dumps(value)


def _runs(items: list) -> Iterator[list]:
    """Consecutive ``items`` in runs of about ``_PIECE`` leaves; an item with containers inside
    (its size unknown) is a run of its own, for :func:`_json_pieces` to take apart."""
    run, leaves = [], 0
    for item in items:
        if not _flat(item):
            if run:
                yield run
            yield [item]
            run, leaves = [], 0
            continue
        run.append(item)
        leaves += len(item) if isinstance(item, (dict, list)) else 1
        if leaves >= _PIECE:
            yield run
            run, leaves = [], 0
    if run:
        yield run


def _flat(value) -> bool:
    """Whether ``value`` holds no dict or list: a leaf, or a container of leaves."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return not any(isinstance(item, (dict, list)) for item in items)


async def json_reply(state: ServerState, build: Callable[[], Any]) -> Response:
    """The reply ``build()`` makes, built and encoded on the tokenizer thread in pieces
    (:func:`json_bytes`): returned as a dict, FastAPI encoded it on the event loop, and a
    reply of a million logprobs held every other request (``/health`` too) for seconds."""
    return Response(await state.off_loop(lambda: json_bytes(build())), media_type="application/json")


def reply_id(prefix: str, req) -> str:
    """vLLM's reply ids: the client's ``request_id`` when it gives one."""
    return f"{prefix}-{req.request_id or uuid.uuid4().hex}"


def usage(outs: list[RequestOutput], n: int = 1, generated: bool = True) -> dict:
    """OpenAI's usage: each prompt's tokens once (its first choice's, which computed what
    the cache did not hold), every choice's completion tokens (none for the prompt alone)."""
    firsts = outs[::n]
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.token_ids) for o in outs) if generated else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.metrics["prompt_tokens_cached"] for o in firsts)}}
