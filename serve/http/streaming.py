"""Server-sent events: a request's choices streamed as their tokens arrive, OpenAI's chunks
(completions' ``text_completion``, chat's ``chat.completion.chunk``), then ``[DONE]``.

What a chunk says is the route's (a ``body`` function, see :func:`chunker`); this module
holds the state machine every stream shares: which choice has sent what, the text held back
(half a UTF-8 character, the possible start of a stop string), the logprob entries and their
text offsets, an error event when a choice fails mid-stream, and aborting every choice when
the client goes away.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from ..engine.llm_engine import RequestOutput
from .jobs import Started
from .logprobs import entry_texts
from .protocol import CompletionRequest, OpenAIRequest
from .replies import usage
from .state import ServerState

Chunk = Callable[..., dict]  # chunk(index, delta, finish_reason, opening, stop_reason, entries, offset, texts)
Final = Callable[[list[RequestOutput]], dict]
# body(index, delta, finish_reason, opening, entries, offset, texts): one choice's part of a chunk
Body = Callable[[int, str | None, str | None, bool, list[dict], int, dict[int, str]], dict]


def stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that begins a stop string: a stream holds it back
    until the next tokens show whether the stop string follows (and would be cut), as vLLM does.
    Only lengths whose last character is the text's last are compared (``rfind`` finds them),
    so long stop strings cost a scan per streamed chunk, not a copy per length."""
    if not text:
        return 0
    last, longest = text[-1], 0
    for stop in stops:
        k = min(len(stop) - 1, len(text))
        while k > longest:
            k = stop.rfind(last, 0, k) + 1  # the longest k' <= k with stop[k' - 1] == last; 0: none
            if k <= longest:
                break
            if text.endswith(stop[:k]):
                longest = k
                break
            k -= 1
    return longest


def chunker(rid: str, created: int, req: OpenAIRequest, model: str, body: Body) -> tuple[Chunk, Final | None]:
    """``chunk`` and ``final`` for :func:`stream_events`: ``body(index, delta, finish, opening,
    entries, offset, texts)`` is one choice's content; with ``include_usage`` every chunk has
    ``usage: null``, as in OpenAI, and ``final`` makes the usage chunk (else it is None)."""
    obj = "text_completion" if isinstance(req, CompletionRequest) else "chat.completion.chunk"
    extra = {"usage": None} if req.include_usage else {}

    def chunk(index, delta, finish, opening, stop=None, entries=(), offset=0, texts=None):
        choice = {"index": index, **body(index, delta, finish, opening, list(entries), offset, texts or {}),
                  "stop_reason": stop}
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], **extra}

    def final(outs):
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                "usage": usage(outs, req.n)}

    return chunk, final if req.include_usage else None


def _event(data: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


class _ChoiceStreams:
    """The state of one request's stream: each choice's latest output, the text and logprob
    entries sent so far, and the next output each running choice is awaited for."""

    def __init__(self, state: ServerState, started: Started, base: str, stops: list[str], chunk: Chunk,
                 final: Final | None, tokenizer):
        self.state, self.base, self.stops = state, base, stops
        self.chunk, self.final, self.tokenizer = chunk, final, tokenizer
        self.streams = [stream for _, stream in started]
        self.outs, self.sent = [first for first, _ in started], [""] * len(started)
        # logprob entries sent and their texts' length
        self.scored, self.offsets = [0] * len(started), [0] * len(started)
        self.pending: dict[asyncio.Future, int] = {}

    async def events(self) -> AsyncIterator[str]:
        """Every event of the stream; a disconnect (the generator closed) aborts every choice."""
        try:
            for index in range(len(self.outs)):
                yield _event(self.chunk(index, None, None, True))
            ready, error = list(range(len(self.outs))), None
            while True:
                for index in ready:
                    event = await self._advance(index)
                    if event is not None:
                        yield event
                    self._follow(index)
                if not self.pending:
                    break
                ready, error = await self._arrivals()
                if error is not None:  # failed mid-stream: say so, as vLLM does, and end
                    yield _event({"error": {"message": error, "type": "server_error", "param": None, "code": 500}})
                    break
            if error is None and self.final is not None:
                yield _event(self.final(self.outs))
            yield "data: [DONE]\n\n"
        finally:
            await self._abort()

    async def _advance(self, index: int) -> str | None:
        """The event for what choice ``index`` has that was not sent, or None when nothing new
        may be sent yet (half a character, the possible start of a stop string)."""
        out = self.outs[index]
        text, sent = out.text, self.sent[index]
        if not out.finished:  # hold back half a character and what may begin a stop string
            text = sent if text.endswith("\ufffd") else text[:len(text) - stop_prefix(text, self.stops)]
        delta = text[len(sent):] if text.startswith(sent) else ""
        self.sent[index] += delta
        if not (delta or out.finished):
            return None
        entries, self.scored[index] = out.logprobs[self.scored[index]:], len(out.logprobs)
        texts = await self.state.off_loop(entry_texts, self.tokenizer, entries) if self.tokenizer and entries else {}
        offset = self.offsets[index]
        self.offsets[index] += sum(len(texts[e["token"]]) for e in entries) if texts else 0
        return _event(self.chunk(index, delta, out.finish_reason, False, out.stop_reason, entries, offset, texts))

    def _follow(self, index: int) -> None:
        """After choice ``index``'s event: observe it if it finished, else await its next output."""
        out = self.outs[index]
        if out.finished:
            self.state.observe(out, self.base)
        else:
            self.pending[asyncio.ensure_future(self.streams[index].__anext__())] = index

    async def _arrivals(self) -> tuple[list[int], str | None]:
        """Wait for the next outputs: the choices that have one (in order), and the message of
        the engine error that failed one of them (None if none did)."""
        done, _ = await asyncio.wait(self.pending, return_when=asyncio.FIRST_COMPLETED)
        arrived = {self.pending.pop(task): task for task in done}
        error = None
        for task in arrived.values():
            if isinstance(task.exception(), RuntimeError):
                error = str(task.exception())
            elif task.exception() is not None:
                raise task.exception()
        if error is None:
            for index, task in arrived.items():
                self.outs[index] = task.result()
        return sorted(arrived), error

    async def _abort(self) -> None:
        """Cancel the awaited outputs and close every choice's stream (aborting those still running)."""
        for task in self.pending:
            task.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)
        for stream in self.streams:
            await stream.aclose()


def stream_events(state: ServerState, started: Started, base: str, stops: list[str], chunk: Chunk,
                  final: Final | None = None, tokenizer=None) -> StreamingResponse:
    """Server-sent events over every choice's stream, merged as their tokens arrive:
    ``chunk(index, delta, finish_reason, opening, stop_reason, entries, offset, texts)`` makes an
    event; ``final(outputs)``, if given, the last one (the usage chunk). With ``tokenizer``
    (logprobs asked for) a chunk carries the logprob entries of the tokens generated since the
    last one (``entries``), their texts (``texts``, decoded off the event loop) and the first
    one's text offset (``offset``: the texts of the tokens before it, as the reply not streamed
    counts them); text held back (a stop string's possible start) holds nothing else back, as
    in vLLM. A choice that fails mid-stream ends the whole stream with an OpenAI-style error
    event, as in vLLM; a disconnect aborts every choice."""
    streams = _ChoiceStreams(state, started, base, stops, chunk, final, tokenizer)
    return StreamingResponse(streams.events(), media_type="text/event-stream")
