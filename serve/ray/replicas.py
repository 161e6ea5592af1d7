"""``kvshare serve --ray``: kvshare engines as Ray Serve replicas behind one HTTP address.

Two deployments. ``KvshareEngine`` replicas each hold an engine over the same base and
adapters and run the very app ``kvshare serve`` runs (:func:`..http.create_app`), called
in-process as an ASGI app. ``KvshareGateway``, the ingress, reads a request's workflow id
(the ``x-session-id`` header, else the body's ``kvshare_hints.workflow_id``) and forwards the
request unchanged to an engine replica through a Ray handle carrying that id as its session
id; the engines' router (:mod:`.router`) then keeps every call of a workflow on one
replica. Without affinity the engines use Ray's default router (power of two choices).
Every reply names its replica in ``x-kvshare-replica`` (and its Ray node in ``x-kvshare-node``).

Ray Serve restarts a replica that dies or fails its health check (the engine thread is
gone) on any node with room; requests caught in a dead replica fail with a 503 and should
be retried by the client (a stream already under way ends with an error event and ``[DONE]``,
as the single server ends a failed stream). The gateway refuses a bad API key (401), an
oversize body (413) and an unbounded workflow id (400) before any replica sees the request,
and cancels the replica's request when its client leaves.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ...errors import KvshareError
from ..api_key import authorized
from ..config import EngineConfig, ServerLimits
from ..hints import MAX_NAME
from .router import WorkflowAffinityRouter, valid_session_id

APP_NAME = "kvshare"
ENGINE_DEPLOYMENT = "KvshareEngine"
GATEWAY_DEPLOYMENT = "KvshareGateway"
REPLICA_HEADER = "x-kvshare-replica"
NODE_HEADER = "x-kvshare-node"
SESSION_HEADER = "x-session-id"
DONE = b"data: [DONE]\n\n"  # the last event of every server-sent event stream
HEAD_NODE_RESOURCE = "node:__internal_head__"  # every Ray head node has it (Ray Train pins its state actor so)


@dataclass(frozen=True)
class RayServeOptions:
    """How many engine replicas, and what each gets."""

    replicas: int = 2
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    threads_per_replica: int | None = None  # default: num_cpus_per_replica, at least 1
    affinity: bool = True  # workflow-affinity routing; False = Ray's default (load) router
    max_ongoing_requests: int | None = None  # per replica; default: the server's max_waiting

    def __post_init__(self):
        if self.replicas < 1:
            raise KvshareError("--replicas must be at least 1")
        if self.num_cpus_per_replica < 0 or self.num_gpus_per_replica < 0:
            raise KvshareError("--num-cpus-per-replica and --num-gpus-per-replica must not be negative")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise KvshareError("--threads-per-replica must be at least 1")

    @property
    def threads(self) -> int:
        return self.threads_per_replica or max(1, int(self.num_cpus_per_replica))


@dataclass(frozen=True)
class EngineSpec:
    """What every replica serves: the arguments of ``kvshare serve`` (paths must exist on every node)."""

    model: str
    adapters: tuple[str, ...] = ()
    config: EngineConfig | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    api_key: str | None = None
    served_model_name: tuple[str, ...] | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora_loading: bool = False
    generation_config: str = "auto"


class KvshareEngine:
    """One replica: an engine and ``kvshare serve``'s app over it, called as an ASGI app."""

    def __init__(self, spec: EngineSpec, threads: int):
        # Ray sets OMP_NUM_THREADS=1 in its workers; a replica gets the threads it was given
        import torch

        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        from ..engine.llm_engine import LLMEngine
        from ..http import create_app

        engine = LLMEngine(spec.model, list(spec.adapters), spec.config)
        for name, path in spec.lora_modules:
            engine.load_adapter(path, name)
        self.app = create_app(engine, api_key=spec.api_key, limits=spec.limits,
                              served_model_name=list(spec.served_model_name or []) or None,
                              enable_lora_loading=spec.enable_lora_loading,
                              generation_config=spec.generation_config)
        self.engine_thread = self.app.state.engine_thread
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died, or whose steps keep
        failing, is replaced."""
        problem = self.engine_thread.health()
        if problem is not None:
            raise RuntimeError(problem)

    async def forward(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> AsyncIterator[dict | bytes]:
        """Run one HTTP request through the app: yields the response head ({"status", "headers"})
        and then its body chunks as they are produced. Cancelled (the client left): the app
        sees a disconnect, which aborts the request's generation."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": query, "root_path": "", "headers": headers,
                 "server": ("kvshare-replica", 0), "client": ("kvshare-gateway", 0)}
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await messages.put(message)

        app = asyncio.ensure_future(self.app(scope, receive, send))
        app.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    head = list(message.get("headers", [])) + [(REPLICA_HEADER.encode(), self.replica.encode()),
                                                               (NODE_HEADER.encode(), self.node.encode())]
                    yield {"status": message["status"], "headers": head}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
            if app.done() and not app.cancelled() and app.exception() is not None:
                raise app.exception()
        finally:
            gone.set()
            if not app.done():
                try:
                    await asyncio.wait_for(app, timeout=5)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    app.cancel()

    def __del__(self):
        engine_thread = getattr(self, "engine_thread", None)
        if engine_thread is not None:
            engine_thread.shutdown()


def workflow_id_of(headers, body: bytes) -> str | None:
    """The routing key: the ``x-session-id`` header, else ``kvshare_hints.workflow_id`` in a
    JSON body. Anything unreadable is no key (the engine's app judges the request itself)."""
    if headers.get(SESSION_HEADER):
        return headers[SESSION_HEADER]
    if not body or b"kvshare_hints" not in body:
        return None
    try:
        hints = json.loads(body).get("kvshare_hints")
        workflow = hints.get("workflow_id") if isinstance(hints, dict) else None
    except (ValueError, AttributeError):
        return None
    return str(workflow) if isinstance(workflow, (str, int)) and not isinstance(workflow, bool) else None


def _error(status: int, message: str, kind: str = "server_error") -> Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return Response(json.dumps(body), status_code=status, media_type="application/json")


async def read_body(chunks: AsyncIterable[bytes], limit: int) -> bytes | None:
    """The whole body, or None once it is over ``limit`` bytes. Joined once at the end:
    ``body += chunk`` copies the body so far per chunk, quadratic in a body sent in small chunks."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


async def _client_gone(request: Request) -> None:
    """Returns when the client has gone: its body was read, so the next ASGI message is the
    disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _head(replies, request: Request) -> dict | Response | None:
    """The reply's head ({"status", "headers"}), an error reply, or None when the client left
    first. The replica's request is cancelled unless its head arrived (a long non-streamed
    completion sends nothing until it ends, and must not run on for nobody)."""
    head = asyncio.ensure_future(replies.__anext__())
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({head, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left = not head.done()
        if left:
            replies.cancel()
        head.cancel()
        gone.cancel()
        await asyncio.gather(head, gone, return_exceptions=True)
    if left:
        return None
    try:
        return head.result()
    except StopAsyncIteration:
        return _error(502, "the engine replica gave no reply")
    except Exception as err:  # noqa: BLE001 - the replica died or could not be reached: retryable
        replies.cancel()
        return _error(503, f"the engine replica failed ({type(err).__name__}); retry the request")


def _is_event_stream(head: dict) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in head["headers"])


def _error_event(err: BaseException) -> bytes:
    """The single server's end of a failed stream (an OpenAI-style error event, then
    ``[DONE]``), for a replica that died mid-stream: retryable, so 503."""
    body = {"message": f"the engine replica failed mid-stream ({type(err).__name__}); retry the request",
            "type": "server_error", "param": None, "code": 503}
    return f"data: {json.dumps({'error': body})}\n\n".encode() + DONE


async def _events(replies) -> AsyncIterator[bytes]:
    """The replica's events; if it dies before ``[DONE]``, an error event and ``[DONE]`` end
    the stream instead of a cut that looks like a finished one."""
    finished = False
    try:
        async for chunk in replies:
            finished = chunk.endswith(DONE)
            yield chunk
    except Exception as err:  # noqa: BLE001 - the replica died mid-stream
        if not finished:
            yield _error_event(err)


class _Relay(StreamingResponse):
    """A streamed reply that cancels its replica's request however it ends: finished, failed
    or the client gone (on ASGI 2.4 Starlette leaves the body iterator unclosed when a send
    fails, so the iterator's own ``finally`` would not run)."""

    def __init__(self, head: dict, replies):
        super().__init__(_events(replies), status_code=head["status"])
        self.raw_headers = list(head["headers"])
        self.replies = replies

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.replies.cancel()


async def _whole(head: dict, replies) -> Response:
    """A reply that is not an event stream, read whole before it is sent: a replica that dies
    mid-reply is a retryable 503, not a cut body."""
    try:
        body = b"".join([chunk async for chunk in replies])
    except Exception as err:  # noqa: BLE001 - the replica died mid-reply
        return _error(503, f"the engine replica failed ({type(err).__name__}); retry the request")
    finally:
        replies.cancel()
    response = Response(body, status_code=head["status"])
    response.raw_headers = [(k, v) for k, v in head["headers"] if k.lower() != b"content-length"] + \
        [(b"content-length", str(len(body)).encode())]
    return response


class KvshareGateway:
    """The ingress: checks the API key, the body's size and the workflow id, then forwards
    each request, unchanged, to an engine replica picked by its workflow id (sticky) or by load."""

    def __init__(self, engine: DeploymentHandle, affinity: bool, max_request_bytes: int,
                 api_key: str | None = None):
        self.engine = engine.options(method_name="forward", stream=True)
        self.affinity, self.max_request_bytes = affinity, max_request_bytes
        self.expected_key = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, request: Request) -> Response:
        if not authorized(request.url.path, request.scope["headers"], self.expected_key):
            return _error(401, "invalid API key", "authentication_error")  # before the body is read
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_request_bytes):
            return self._too_large()
        body = await read_body(request.stream(), self.max_request_bytes)
        if body is None:
            return self._too_large()
        workflow = workflow_id_of(request.headers, body)
        if workflow is not None and not valid_session_id(workflow):
            return _error(400, f"the workflow id ({SESSION_HEADER} or kvshare_hints.workflow_id) must be 1 to "
                          f"{MAX_NAME} printable ASCII characters without spaces", "invalid_request_error")
        replies = self._forward(request, body, workflow if self.affinity else None)
        head = await _head(replies, request)
        if head is None:
            return Response(status_code=499)  # the client left: nobody reads this
        if isinstance(head, Response):
            return head
        return _Relay(head, replies) if _is_event_stream(head) else await _whole(head, replies)

    def _too_large(self) -> Response:
        return _error(413, f"the request body is over {self.max_request_bytes} bytes", "invalid_request_error")

    def _forward(self, request: Request, body: bytes, workflow: str | None):
        """Send the request to a replica (by ``workflow``'s affinity, else by load); returns
        the stream of its reply."""
        handle = self.engine.options(session_id=workflow) if workflow else self.engine
        headers = [(k, v) for k, v in request.scope["headers"]
                   if k.lower() not in (b"content-length", b"transfer-encoding")]  # the body is whole now
        headers.append((b"content-length", str(len(body)).encode()))
        return handle.remote(request.method, request.url.path, request.scope.get("query_string", b""),
                             headers, body)


def build_app(spec: EngineSpec, options: RayServeOptions) -> serve.Application:
    """The Ray Serve application: the gateway bound to ``options.replicas`` engine replicas."""
    router = RequestRouterConfig(request_router_class=WorkflowAffinityRouter) if options.affinity \
        else RequestRouterConfig()
    # no runtime_env: the replica sets its threads itself (KvshareEngine), and Ray starts the
    # workers of a runtime_env through a shell command that breaks on a venv in a path with spaces
    actor = {"num_cpus": options.num_cpus_per_replica, "num_gpus": options.num_gpus_per_replica}
    engine = serve.deployment(KvshareEngine, name=ENGINE_DEPLOYMENT, num_replicas=options.replicas,
                              ray_actor_options=actor, request_router_config=router,
                              max_ongoing_requests=options.max_ongoing_requests or spec.limits.max_waiting,
                              health_check_period_s=2, health_check_timeout_s=30,
                              graceful_shutdown_timeout_s=5)
    # The gateway holds the router, and the router holds the workflow -> replica table: it runs
    # on the head node, beside the (head-only) HTTP proxy, so losing a worker node never loses
    # the table and with it the placement of workflows whose replica is still alive.
    gateway = serve.deployment(KvshareGateway, name=GATEWAY_DEPLOYMENT, num_replicas=1,
                               ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
                               max_ongoing_requests=100_000)
    return gateway.bind(engine.bind(spec, options.threads), options.affinity, spec.limits.max_request_bytes,
                        spec.api_key)


def start(spec: EngineSpec, options: RayServeOptions, *, host: str = "127.0.0.1", port: int = 8000,
          ray_address: str | None = None, timeout_s: float = 600) -> str:
    """Deploy onto the Ray cluster at ``ray_address`` (default: start a local one) and return
    the base URL once every replica is up and the URL answers. The HTTP proxy runs on the head
    node only; the first start on a cluster fixes its host and port (Ray Serve's rule)."""
    _check_paths(spec)
    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, logging_level="WARNING",
                 log_to_driver=False)
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    # serve.run waits, without a timeout, for the app to run (replicas that cannot be placed:
    # forever; a constructor that fails: a traceback); wait_healthy waits with both handled
    serve.run_many([serve.RunTarget(build_app(spec, options), name=APP_NAME, route_prefix="/")],
                   wait_for_applications_running=False)
    wait_healthy(options.replicas, timeout_s)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    _wait_answers(url, timeout_s)
    return url


def _wait_answers(url: str, timeout_s: float) -> None:
    """Wait for ``url``/health to answer 200 through the proxy."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + min(timeout_s, 60)
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise KvshareError(f"nothing answers at {url}/health: is Ray Serve already running on this "
                               "cluster with another host or port?")
        time.sleep(0.2)


def running_replicas() -> int:
    """Engine replicas Ray Serve reports RUNNING now."""
    app = serve.status().applications.get(APP_NAME)
    deployment = app and app.deployments.get(ENGINE_DEPLOYMENT)
    return deployment.replica_states.get("RUNNING", 0) if deployment else 0


def wait_healthy(replicas: int, timeout_s: float = 600) -> float:
    """Wait until ``replicas`` engine replicas run; returns when (time.monotonic())."""
    deadline = time.monotonic() + timeout_s
    while running_replicas() < replicas:
        app = serve.status().applications.get(APP_NAME)
        if app is not None and app.status == "DEPLOY_FAILED":  # e.g. a replica's engine refused its settings
            messages = "\n".join([str(d.message or "") for d in app.deployments.values()] + [str(app.message or "")])
            raise KvshareError(f"Ray Serve could not deploy kvshare: {_failure_reason(messages)}")
        if time.monotonic() > deadline:
            raise KvshareError(f"Ray Serve did not bring up {replicas} kvshare replicas in {timeout_s:.0f} s "
                               f"(status: {serve.status().applications.get(APP_NAME)})")
        time.sleep(0.2)
    return time.monotonic()


def _failure_reason(message: str) -> str:
    """One line of Ray Serve's failure message (a replica's traceback, often): kvshare's own
    error where it is one, else the message's last line."""
    found = re.search(r"KvshareError: ([^\n]+)", message)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return found.group(1).strip() if found else (lines[-1] if lines else "no reason given")


def serve_forever(spec: EngineSpec, options: RayServeOptions, *, host: str = "127.0.0.1", port: int = 8000,
                  ray_address: str | None = None) -> None:
    """``kvshare serve --ray``: deploy, print the address, serve until interrupted."""
    if not ray.is_initialized():  # the replicas' logs come to this terminal
        ray.init(address=ray_address, include_dashboard=False, logging_level="WARNING")
    url = start(spec, options, host=host, port=port, ray_address=ray_address)
    routing = "workflow affinity (x-session-id / kvshare_hints.workflow_id)" if options.affinity else "load only"
    print(f"kvshare: {options.replicas} replica(s) on Ray Serve at {url} ({routing}); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)  # a cluster we joined keeps running; a local one ends with us
        if ray_address is None:
            serve.shutdown()
        ray.shutdown()


def _check_paths(spec: EngineSpec) -> None:
    """Fail here, with one line, on a model or adapter folder that is not there (not in every replica)."""
    from ...models import resolve_model_dir

    resolve_model_dir(spec.model)
    for path in list(spec.adapters) + [p for _, p in spec.lora_modules]:
        if not Path(path).is_dir():
            raise KvshareError(f"adapter folder {path} does not exist")
