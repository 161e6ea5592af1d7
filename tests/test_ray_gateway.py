"""The Ray gateway and router without a Ray cluster: the gateway is called as Ray Serve calls
it (a Starlette request in, a response run as an ASGI app), over a fake engine handle that
records what reached a replica and whether its request was cancelled."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("ray")

from starlette.requests import ClientDisconnect, Request  # noqa: E402

from kvshare.serve.ray.replicas import KvshareGateway, read_body  # noqa: E402
from kvshare.serve.ray.router import WorkflowAffinityRouter, valid_session_id  # noqa: E402

SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON = [(b"content-type", b"application/json")]
DONE = b"data: [DONE]\n\n"


class FakeReplies:
    """A replica's reply stream: ``items`` in order (an exception is raised there), then, if
    ``hang``, nothing until cancelled, or, if ``tick``, an event every 10 ms until cancelled."""

    def __init__(self, items: list, hang: bool = False, tick: bool = False):
        self.items, self.hang, self.tick = list(items), hang, tick
        self.cancelled = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            item = self.items.pop(0)
            if isinstance(item, BaseException):
                raise item
            return item
        if self.tick and not self.cancelled.is_set():
            await asyncio.sleep(0.01)
            return b"data: {}\n\n"
        if self.hang or self.tick:
            await self.cancelled.wait()
            raise asyncio.CancelledError
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled.set()


class FakeEngine:
    """A deployment handle: every ``remote`` call is a request that reached a replica."""

    def __init__(self, replies: FakeReplies | None = None):
        self.replies = replies or FakeReplies([{"status": 200, "headers": JSON}, b'{"ok": true}'])
        self.calls: list[tuple] = []
        self.session_id: str | None = None

    def options(self, **kwargs) -> FakeEngine:
        self.session_id = kwargs.get("session_id", self.session_id)
        return self

    def remote(self, *args) -> FakeReplies:
        self.calls.append(args)
        return self.replies


class Client:
    """One HTTP exchange: sends the body in ``chunks``, stays until ``leave`` is set, and
    records what the gateway sends. ``spec`` is the ASGI spec version the server declares."""

    def __init__(self, chunks: list[bytes], spec: str = "2.3"):
        self.chunks, self.spec = list(chunks), spec
        self.leave = asyncio.Event()
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        if self.chunks:
            body = self.chunks.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(self.chunks)}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self.leave.is_set() and self.spec >= "2.4":
            raise OSError("the client has gone")  # what ASGI 2.4 servers do instead of a disconnect message
        self.sent.append(message)

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


async def call(gateway: KvshareGateway, client: Client, path: str = "/v1/completions",
               headers: dict[str, str] | None = None) -> Client:
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": client.spec}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "server": ("test", 80), "client": ("test", 1),
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    response = await gateway(Request(scope, client.receive))
    await response(scope, client.receive, client.send)
    return client


def run(coro, timeout_s: float = 10):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def completion(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


# 1. the API key


def test_the_gateway_checks_the_api_key_before_any_replica_sees_the_request():
    from kvshare.serve.api_key import GUARDED

    for path in ["/v1/completions", "/v1/chat/completions", "/v1/models", *GUARDED]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "secret"}):
            engine = FakeEngine()
            client = run(call(KvshareGateway(engine, True, 1 << 20, api_key="secret"), Client([b"{}"]), path,
                              headers))
            assert client.status == 401, (path, headers)
            assert json.loads(client.body)["error"]["type"] == "authentication_error"
            assert engine.calls == [], (path, headers)
    for path, headers in (("/v1/completions", {"authorization": "Bearer secret"}), ("/health", {}),
                          ("/metrics", {})):
        engine = FakeEngine()
        client = run(call(KvshareGateway(engine, True, 1 << 20, api_key="secret"), Client([b"{}"]), path, headers))
        assert client.status == 200 and len(engine.calls) == 1, path


# 2. session ids


def test_session_ids_are_bounded_in_length_and_charset():
    assert valid_session_id("wf0-1a2b3c4d") and valid_session_id("x" * 256)
    for bad in ("", "x" * 257, "has space", "tab\there", "caf\u00e9", "\x00", "a\nb"):
        assert not valid_session_id(bad), bad


def test_the_gateway_refuses_unbounded_session_ids_and_routes_bounded_ones():
    cases = [({"x-session-id": "w" * 10_000}, completion()),
             ({"x-session-id": "caf\u00e9".encode().decode("latin-1")}, completion()),
             ({}, completion(kvshare_hints={"workflow_id": "w" * 100_000})),
             ({}, completion(kvshare_hints={"workflow_id": "two words"}))]
    for affinity in (True, False):
        for headers, body in cases:
            engine = FakeEngine()
            client = run(call(KvshareGateway(engine, affinity, 1 << 20), Client([body]), headers=headers))
            assert client.status == 400 and engine.calls == [] and engine.session_id is None, headers
            assert "workflow id" in json.loads(client.body)["error"]["message"]
    engine = FakeEngine()
    run(call(KvshareGateway(engine, True, 1 << 20), Client([completion(kvshare_hints={"workflow_id": "wf-7"})])))
    assert engine.session_id == "wf-7" and len(engine.calls) == 1


def _router(max_workflows: int) -> WorkflowAffinityRouter:
    """The router over two replicas of a fake deployment."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    from ray.serve.request_router import ReplicaID

    async def build():
        deployment = DeploymentID(name="KvshareEngine", app_name="kvshare")
        router = WorkflowAffinityRouter(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(max_workflows=max_workflows)
        replicas = {ReplicaID(unique_id=f"r{i}", deployment_id=deployment): object() for i in range(2)}
        router._replicas = replicas
        router._rebuild_ring(frozenset(replicas))
        return router

    return asyncio.run(build())


def test_the_router_table_is_bounded_and_forgets_the_least_recently_routed():
    router = _router(max_workflows=50)
    first = router.replica_for("wf-0")
    for i in range(1, 500):
        assert router.replica_for(f"wf-{i}") is not None
        router.replica_for("wf-0")  # kept recent: never forgotten
    assert len(router._placed) == 50
    assert "wf-0" in router._placed and router.replica_for("wf-0") == first
    assert "wf-1" not in router._placed and "wf-499" in router._placed
    with pytest.raises(ValueError, match="max_workflows"):
        _router(max_workflows=0)


def test_the_router_load_balances_session_ids_it_cannot_bound():
    from types import SimpleNamespace

    router = _router(max_workflows=50)
    candidates = list(router._replicas.values())

    def pending(session_id: str):
        return SimpleNamespace(metadata=SimpleNamespace(session_id=session_id),
                               routing_context=SimpleNamespace(should_backoff=False))

    for bad in ("w" * 100_000, "two words"):
        assert asyncio.run(router.choose_replicas(candidates, pending(bad))) == [candidates]
    assert len(router._placed) == 0
    assert len(asyncio.run(router.choose_replicas(candidates, pending("wf-1")))) == 1
    assert list(router._placed) == ["wf-1"]


# 3. the body


def test_a_body_in_many_small_chunks_is_read_in_linear_time():
    """16 MB in 4 KB chunks: joined once, a few milliseconds; ``body += chunk`` copies 34 GB."""
    chunk, count = b"x" * 4096, 4096
    engine = FakeEngine()
    gateway = KvshareGateway(engine, True, 32 << 20)
    began = time.perf_counter()
    client = run(call(gateway, Client([chunk] * count)), timeout_s=60)
    elapsed = time.perf_counter() - began
    assert client.status == 200 and len(engine.calls[0][4]) == len(chunk) * count
    assert elapsed < 1.0, f"{elapsed:.2f} s to read {len(chunk) * count >> 20} MB"


def test_a_body_over_the_limit_is_413_and_never_reaches_a_replica():
    for chunks, headers in (([b"x" * 600] * 2, {}), ([b"x" * 600], {"content-length": "1200"}),
                            ([b"x"], {"content-length": "-1"})):
        engine = FakeEngine()
        client = run(call(KvshareGateway(engine, True, 1000), Client(chunks), headers=headers))
        assert client.status == 413 and engine.calls == [], headers
        assert json.loads(client.body)["error"]["code"] == 413
    assert run(read_body(_chunks([b"ab", b"", b"cd"]), 4)) == b"abcd"
    assert run(read_body(_chunks([b"ab", b"cde"]), 4)) is None


async def _chunks(items: list[bytes]):
    for item in items:
        yield item


# 4. a replica that dies mid-reply


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_event_and_done():
    events = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n']
    replies = FakeReplies([{"status": 200, "headers": SSE}, *events, RuntimeError("actor died")])
    client = run(call(KvshareGateway(FakeEngine(replies), True, 1 << 20), Client([completion(stream=True)])))
    assert client.status == 200 and client.body.startswith(b"".join(events))
    *_, error, done = client.body.decode().split("\n\n")[:-1]
    assert done == "data: [DONE]"
    error = json.loads(error.removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == 503 and "retry" in error["message"]
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_a_stream_that_finished_before_its_replica_died_gets_no_error_event():
    replies = FakeReplies([{"status": 200, "headers": SSE}, b"data: {}\n\n", DONE, RuntimeError("actor died")])
    client = run(call(KvshareGateway(FakeEngine(replies), True, 1 << 20), Client([completion(stream=True)])))
    assert client.body == b"data: {}\n\n" + DONE


def test_a_replica_dying_mid_reply_is_a_retryable_503_not_a_cut_body():
    replies = FakeReplies([{"status": 200, "headers": JSON}, b'{"choices": [', RuntimeError("actor died")])
    client = run(call(KvshareGateway(FakeEngine(replies), True, 1 << 20), Client([completion()])))
    assert client.status == 503 and "retry" in json.loads(client.body)["error"]["message"]


# 5. the client leaving


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_client_leaving_mid_stream_cancels_the_replicas_request(spec):
    replies = FakeReplies([{"status": 200, "headers": SSE}], tick=True)  # generating until cancelled
    client = Client([completion(stream=True)], spec)

    async def leave_after_first_event():
        while len(client.sent) < 2:
            await asyncio.sleep(0.01)
        client.leave.set()

    async def exchange():
        leaving = asyncio.ensure_future(leave_after_first_event())
        try:
            await call(KvshareGateway(FakeEngine(replies), True, 1 << 20), client)
        except ClientDisconnect:
            pass  # Starlette's word for the failed send (ASGI 2.4)
        await leaving
        await asyncio.wait_for(replies.cancelled.wait(), 5)

    run(exchange())


def test_a_client_leaving_before_the_reply_starts_cancels_the_replicas_request():
    """A non-streamed completion sends nothing until it ends: the gateway must watch the client."""
    replies = FakeReplies([], hang=True)
    client = Client([completion(max_tokens=4000)])

    async def exchange():
        gateway = asyncio.ensure_future(call(KvshareGateway(FakeEngine(replies), True, 1 << 20), client))
        await asyncio.sleep(0.05)
        client.leave.set()
        await asyncio.wait_for(replies.cancelled.wait(), 5)
        await gateway

    run(exchange())


def test_a_cancelled_gateway_cancels_the_replicas_request():
    """Ray Serve cancels the gateway's request when its client disconnects."""
    replies = FakeReplies([], hang=True)

    async def exchange():
        gateway = asyncio.ensure_future(call(KvshareGateway(FakeEngine(replies), True, 1 << 20),
                                             Client([completion()])))
        await asyncio.sleep(0.05)
        gateway.cancel()
        await asyncio.wait_for(replies.cancelled.wait(), 5)

    run(exchange())
