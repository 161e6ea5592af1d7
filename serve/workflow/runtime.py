"""Agent workflows over one shared context: ReAct, Reflexion and MapReduce.

Agents are (name, adapter, role prompt). A workflow keeps its conversation as token ids, so
every agent's prompt starts with exactly the tokens the previous calls saw: with ICaRus
adapters that prefix is one shared KV cache; with conventional LoRA each agent needs its
own. Tools are simulated (a fixed delay and a fixed-length observation cut from the task's
own text). Calls go to the in-process engine or to a kvshare server; each carries typed
hints (:mod:`..hints`): the workflow and agent ids and the steps to every agent's next call,
read off the pattern's step graph (:mod:`..task_graph`), which KVFlow's step-aware eviction
and prefetch use. Over HTTP the ids also travel as headers, for routers.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

from ...errors import KvshareError
from ..driver.engine_thread import AsyncEngine
from ..sampling_params import SamplingParams
from ..task_graph import StepGraph


@dataclass(frozen=True)
class Agent:
    name: str
    adapter: str | None  # None = the base model
    role: str  # role prompt, e.g. "You check facts."
    invocation: tuple[int, ...] = ()  # aLoRA: token ids that switch the adapter on


@dataclass
class CallRecord:
    workflow: int
    agent: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    start: float
    first_token: float
    end: float

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> float:
        return self.first_token - self.start


@dataclass(frozen=True)
class SimulatedTool:
    delay_s: float = 0.0
    observation_tokens: int = 32

    def observe(self, source: list[int], step: int) -> list[int]:
        """A fixed-length slice of the task text, different for every step."""
        if not source:
            return []
        start = (step * self.observation_tokens) % len(source)
        return (source[start:] + source)[: self.observation_tokens]


class RoundRobin:
    def __init__(self, agents: list[Agent]):
        self.agents = agents

    def pick(self, turn: int) -> Agent:
        return self.agents[turn % len(self.agents)]


class Skewed:
    """One agent takes half the turns, the others share the rest at random (seeded)."""

    def __init__(self, agents: list[Agent], seed: int = 0):
        rng = random.Random(seed)
        self.agents = agents
        self._plan: list[Agent] = []
        self._rng = rng

    def pick(self, turn: int) -> Agent:
        while len(self._plan) <= turn:
            others = self.agents[1:] or self.agents
            self._plan.append(self.agents[0] if self._rng.random() < 0.5 else self._rng.choice(others))
        return self._plan[turn]


class Completion(NamedTuple):
    """One call's answer from a backend: the ids the history goes on with, the prompt tokens
    served from cache, the time of the first token, and the tokens generated (a server's own
    count: its text, encoded again, need not have as many)."""

    ids: list[int]
    cached_tokens: int
    first_token: float
    generated: int


class EngineBackend:
    """Calls the in-process engine (through its asyncio runner)."""

    def __init__(self, runner: AsyncEngine):
        if len(runner.colocation.engines) != 1:
            raise KvshareError("EngineBackend calls one engine; for co-located models use ServerBackend over "
                               "their server (its model field picks the engine)")
        self.runner = runner
        self.tokenizer = runner.engine.tokenizer

    async def complete(self, prompt: list[int], adapter: str | None, max_tokens: int, hints: dict) -> Completion:
        first = None
        out = None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        async for out in self.runner.generate(prompt, params, adapter, hints):
            first = first or time.perf_counter()
        return Completion(list(out.token_ids), out.metrics["prompt_tokens_cached"], first, len(out.token_ids))


class ServerBackend:
    """Calls an OpenAI-compatible server (kvshare's, or a router or vLLM in front) through the
    OpenAI client, streamed; the final usage chunk gives the prompt tokens served from cache."""

    def __init__(self, base_url: str, api_key: str, base_model: str, tokenizer, send_hints: bool = True,
                 ignore_eos: bool = False, text_prompts: bool = False, retries: int = 0,
                 retry_delay_s: float = 0.5):
        """``send_hints=False`` for servers other than kvshare (vLLM as a benchmark peer): the
        workflow id still goes as the ``x-session-id`` header routers read. ``ignore_eos``
        (vLLM's field) makes every call generate ``max_tokens``, as the in-process backend does.
        ``text_prompts`` sends the prompt as text, for routers that take no token ids (``smg``);
        the server tokenises it again, which may split the text differently than the ids did.
        ``retries``: a call that fails to connect, gets a 5xx (before or inside its stream) or
        a stream cut short (a replica that died) is sent again, up to this many times,
        ``retry_delay_s`` apart. ``calls``
        logs every answered call with the replica that served it (``x-kvshare-replica``)."""
        import openai

        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        self.base_model = base_model
        self.tokenizer = tokenizer
        self.send_hints, self.ignore_eos, self.text_prompts = send_hints, ignore_eos, text_prompts
        self.retries, self.retry_delay_s = retries, retry_delay_s
        self.calls: list[dict] = []

    async def complete(self, prompt: list[int], adapter: str | None, max_tokens: int, hints: dict) -> Completion:
        import openai

        start = time.perf_counter()
        for attempt in range(self.retries + 1):
            try:
                answer = await self._complete_once(prompt, adapter, max_tokens, hints, attempt)
                self.calls[-1]["start"] = start
                return answer
            except (openai.APIError, _CutShort) as err:
                if attempt == self.retries or not _retryable(err):
                    raise
                await asyncio.sleep(self.retry_delay_s)
        raise AssertionError("unreachable")

    async def _complete_once(self, prompt: list[int], adapter: str | None, max_tokens: int, hints: dict,
                             attempt: int) -> Completion:
        first, text, cached, usage = None, "", 0, None
        headers = {"x-session-id": hints["workflow_id"], "x-kvshare-agent-id": hints["agent_id"]}
        body = {"kvshare_hints": hints} if self.send_hints else {}
        if self.ignore_eos:
            body["ignore_eos"] = True
        sent = self.tokenizer.decode(prompt) if self.text_prompts else prompt
        raw = await self.client.completions.with_raw_response.create(
            model=adapter or self.base_model, prompt=sent, max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body=body, extra_headers=headers)
        async for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter()
                text += chunk.choices[0].text
            usage = chunk.usage or usage
            details = chunk.usage and chunk.usage.prompt_tokens_details
            if details and details.cached_tokens:
                cached = details.cached_tokens
        if usage is None:  # the stream ended before its usage chunk: the server went away
            raise _CutShort("the stream ended without its usage chunk (the server went away)")
        first = first or time.perf_counter()
        self.calls.append({"workflow_id": hints["workflow_id"], "agent_id": hints["agent_id"],
                           "replica": raw.headers.get("x-kvshare-replica"), "node": raw.headers.get("x-kvshare-node"),
                           "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached, "attempts": attempt + 1,
                           "end": time.perf_counter()})
        return Completion(self.tokenizer.encode(text, add_special_tokens=False), cached, first, usage.completion_tokens)


class _CutShort(Exception):
    """A streamed reply that ended without its usage chunk."""


def _retryable(err: Exception) -> bool:
    """A failure another try may not meet: no connection, a 5xx status, a stream cut short, or
    a 5xx error event inside the stream (a plain APIError: the replica failed the call after
    it began). A 4xx, in the status or in the stream, is the request's own: not retried."""
    import openai

    if isinstance(err, (_CutShort, openai.APIConnectionError, openai.InternalServerError)):
        return True
    return type(err) is openai.APIError and str(err.code or "").startswith("5")


@dataclass
class Workflow:
    """One task run by a team of agents; ``history`` is the shared conversation in tokens."""

    index: int
    backend: object
    context: list[int]
    max_tokens: int = 16
    tool: SimulatedTool = field(default_factory=SimulatedTool)
    records: list[CallRecord] = field(default_factory=list)

    def __post_init__(self):
        self.history = list(self.context)
        self._tok = self.backend.tokenizer
        self.workflow_id = f"wf{self.index}-{uuid.uuid4().hex[:8]}"  # unique across runs

    def _header(self, agent: Agent, text: str = "") -> list[int]:
        if agent.invocation:
            return list(agent.invocation)
        return self._tok.encode(f"\n[{agent.name}] {agent.role}{text}\n", add_special_tokens=False)

    async def call(self, agent: Agent, prompt: list[int], graph: StepGraph, done: set[str]) -> list[int]:
        """One LLM call of ``agent``; its hints give every agent's steps to its next call once
        the nodes ``done`` (this call's included) have run: the next agent is 1 step away."""
        steps = {a: s + 1 for a, s in graph.agent_steps(done).items()}
        hints = {"workflow_id": self.workflow_id, "agent_id": agent.name, "steps_to_execution": steps}
        start = time.perf_counter()
        answer = await self.backend.complete(prompt, agent.adapter, self.max_tokens, hints)
        self.records.append(CallRecord(self.index, agent.name, len(prompt), answer.cached_tokens, answer.generated,
                                       start, answer.first_token, time.perf_counter()))
        return answer.ids

    async def observe(self, step: int) -> None:
        if self.tool.delay_s:
            await asyncio.sleep(self.tool.delay_s)
        self.history += self._tok.encode("\nObservation: ", add_special_tokens=False)
        self.history += self.tool.observe(self.context, step)

    async def react(self, order, turns: int) -> None:
        """Thought -> action (tool) -> observation, one agent per turn, all on one history."""
        graph = StepGraph.chain([order.pick(turn).name for turn in range(turns)])
        for turn in range(turns):
            agent = order.pick(turn)
            prompt = self.history + self._header(agent)
            thought = await self.call(agent, prompt, graph, {f"n{t}" for t in range(turn + 1)})
            self.history = prompt + thought
            if turn < turns - 1:  # the last thought is the answer: no tool call after it
                await self.observe(turn)

    async def reflexion(self, actor: Agent, critic: Agent, rounds: int) -> None:
        """The actor tries, the critic reflects, the actor tries again with the reflection."""
        graph = StepGraph.chain([actor.name, critic.name] * rounds)
        for step in range(rounds):
            prompt = self.history + self._header(actor)
            self.history = prompt + await self.call(actor, prompt, graph, {f"n{t}" for t in range(2 * step + 1)})
            await self.observe(step)
            prompt = self.history + self._header(critic)
            self.history = prompt + await self.call(critic, prompt, graph, {f"n{t}" for t in range(2 * step + 2)})

    async def mapreduce(self, mappers: list[Agent], reducer: Agent) -> None:
        """Every mapper answers from the shared context at once; the reducer reads them all."""
        graph = StepGraph.fan_in([m.name for m in mappers], reducer.name)
        prompts = [self.history + self._header(m) for m in mappers]
        outputs = await asyncio.gather(*(self.call(m, p, graph, {f"map{i}"})
                                         for i, (m, p) in enumerate(zip(mappers, prompts))))
        for mapper, out in zip(mappers, outputs):
            self.history += self._header(mapper) + out
        prompt = self.history + self._header(reducer)
        self.history = prompt + await self.call(reducer, prompt, graph, set(graph.nodes))
