"""The HTTP layer's parts on their own, without an engine or a server: the SSE state machine,
the logprob formatters, the JSON encoding in pieces, the limits and the sampling of n choices.
The routes themselves are tested through a running server (test_server*.py)."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest

from kvshare.serve.config import ServerLimits
from kvshare.serve.http.errors import ApiError
from kvshare.serve.http.limits import check_limits
from kvshare.serve.http.logprobs import chat_logprobs, completion_logprobs
from kvshare.serve.http.middleware import lone_surrogate_at
from kvshare.serve.http.params import choice_params
from kvshare.serve.http.protocol import ChatRequest, CompletionRequest
from kvshare.serve.http.replies import _PIECE, json_bytes
from kvshare.serve.http.streaming import chunker, stream_events
from kvshare.serve.engine.output import RequestOutput
from kvshare.serve.sampling_params import SamplingParams


def _out(text: str, finished: bool = False, logprobs=()) -> RequestOutput:
    return RequestOutput("r", [1, 2], [3] * len(text), text, finished, "stop" if finished else None, None,
                         logprobs=list(logprobs), metrics={"prompt_tokens_cached": 0})


class _FakeState:
    """What the SSE state machine uses of ServerState: the tokenizer thread and the metrics."""

    def __init__(self):
        self.observed = []

    async def off_loop(self, work, *args):
        return work(*args)

    def observe(self, out, base):
        self.observed.append((out.text, base))


async def _stream_of(*outs):
    for out in outs:
        if isinstance(out, BaseException):
            raise out
        yield out


def _body(index, delta, finish, opening, entries, offset, texts):
    return {"text": delta or "", "finish_reason": finish}


async def _events(state, started, stops, req):
    response = stream_events(state, started, "base", stops, *chunker("cmpl-1", 0, req, "m", _body))
    return [chunk async for chunk in response.body_iterator]


def test_a_stream_holds_back_a_possible_stop_string_and_half_characters_then_ends_with_usage():
    state, req = _FakeState(), CompletionRequest(prompt="p", stream=True, stream_options={"include_usage": True})
    later = [_out("Hello wo\ufffd"), _out("Hello world!", finished=True)]
    started = [(_out("Hello w"), _stream_of(*later))]
    events = asyncio.run(_events(state, started, ["wor"], req))
    data = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert events[-1] == "data: [DONE]\n\n"
    texts = [d["choices"][0]["text"] for d in data if d["choices"]]
    assert texts == ["", "Hello ", "world!"]  # "w" may begin "wor"; "wo\ufffd" is half a character
    assert all(d["usage"] is None for d in data[:-1]) and data[-1]["usage"]["completion_tokens"] == 12
    assert state.observed == [("Hello world!", "base")]


def test_a_choice_failing_mid_stream_ends_the_stream_with_an_error_event():
    state, req = _FakeState(), CompletionRequest(prompt="p", stream=True, n=2)
    started = [(_out("a"), _stream_of(RuntimeError("the engine failed"))),
               (_out("b"), _stream_of(_out("bc", finished=True)))]
    events = asyncio.run(_events(state, started, [], req))
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error == {"message": "the engine failed", "type": "server_error", "param": None, "code": 500}
    assert events[-1] == "data: [DONE]\n\n"


def test_completion_logprobs_offsets_and_alternatives_by_text():
    texts = {1: "a", 2: "bc", 3: "bc"}
    block = completion_logprobs(texts, [(1, None), (2, {"logprob": -0.5, "top": {3: -0.1, 2: -0.5}})], offset=4)
    assert block["tokens"] == ["a", "bc"] and block["token_logprobs"] == [None, -0.5]
    assert block["text_offset"] == [4, 5]
    assert block["top_logprobs"] == [None, {"bc": -0.1}]  # tokens that decode alike keep the best
    chat = chat_logprobs({1: "é"}, [{"token": 1, "logprob": -1.0, "top": {1: -1.0}}])
    assert chat["content"][0]["bytes"] == [0xC3, 0xA9]


@pytest.mark.parametrize("value", [
    {"a": [1, 2.5, "x"], "b": {"c": [None, True]}, "é": "ü"},
    [list(range(3 * _PIECE + 5)), [{"k": i} for i in range(_PIECE + 1)], "tail"],
    {"choices": [{"logprobs": {"tokens": ["t"] * (_PIECE + 3)}}], "usage": {"n": 1}},
])
def test_json_in_pieces_is_what_one_dumps_writes(value):
    assert json_bytes(value) == json.dumps(value, ensure_ascii=False, allow_nan=False,
                                           separators=(",", ":")).encode()
    with pytest.raises(ValueError):
        json_bytes({"x": [math.nan]})


def test_each_choice_draws_with_its_own_seed_wrapped_to_64_bits():
    plain = SamplingParams(max_tokens=1)
    assert choice_params(plain, 3) == [plain] * 3
    seeds = [p.seed for p in choice_params(SamplingParams(max_tokens=1, seed=2 ** 63 - 2), 3)]
    assert seeds == [2 ** 63 - 2, 2 ** 63 - 1, -2 ** 63]


@pytest.mark.parametrize("fields,param", [
    ({"n": 17}, "n"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"top_k": 101}, "top_k"),
    ({"stop_token_ids": [100]}, "stop_token_ids"),
    ({"allowed_token_ids": [0] * 101}, "allowed_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"kvshare_hints": {"a": [[[[[[[[1]]]]]]]]}}, "kvshare_hints"),
])
def test_limits_refuse_naming_the_field(fields, param):
    with pytest.raises(ApiError) as refused:
        check_limits(CompletionRequest(prompt="p", **fields), ServerLimits(), vocab_size=100)
    assert refused.value.status == 400 and refused.value.param == param


def test_top_logprobs_without_logprobs_is_refused_in_chat():
    req = ChatRequest(messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
    with pytest.raises(ApiError, match="top_logprobs needs logprobs"):
        check_limits(req, ServerLimits(), vocab_size=100)


def test_a_lone_surrogate_is_found_by_its_path():
    assert lone_surrogate_at({"messages": [{"content": "ok"}, {"content": "\ud800"}]}) == "messages.1.content"
    assert lone_surrogate_at({"fine": ["😀", {"k": 1}]}) is None
