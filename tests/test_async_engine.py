"""The engine thread's delivery: a reader that stops reading holds one output, not one per token."""

from __future__ import annotations

import asyncio

from kvshare.serve import LLMEngine, SamplingParams
from kvshare.serve.driver.engine_thread import AsyncEngine

from test_engine import base  # noqa: F401


def test_a_stalled_reader_holds_only_the_newest_output(base):
    runner = AsyncEngine(LLMEngine(base, kv_cache_tokens=1024, block_size=8))

    async def main():
        stream = runner.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
        first = await stream.__anext__()  # tokens made before this read are merged too
        while runner.engine.has_unfinished():  # the reader stalls while every token is made
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        rest = [out async for out in stream]
        return first, rest

    try:
        first, rest = asyncio.run(main())
    finally:
        runner.shutdown()
    assert len(rest) == 1 and rest[0].finished and len(rest[0].token_ids) == 40  # merged, newest only
    assert len(first.token_ids) < 40 and rest[0].token_ids[:len(first.token_ids)] == first.token_ids


def test_a_reader_behind_gets_the_output_made_before_a_failure_then_the_error(base):
    """A request failed while its reader had an output still unread: the reader gets that
    output first (the tokens made), then the error, which is final."""
    runner = AsyncEngine(LLMEngine(base, kv_cache_tokens=1024, block_size=8))
    real_run = runner.engine.runner.run

    def faulty(plans, adapters):
        if any(len(p.seq.output) >= 3 for p in plans):
            raise RuntimeError("simulated fault")
        return real_run(plans, adapters)

    runner.engine.runner.run = faulty

    async def main():
        stream = runner.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
        first = await stream.__anext__()  # tokens made before this read are merged too
        while runner.engine.counters["failed"] < 1:  # the reader stalls while the request fails
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the failure's delivery
        rest, error = [], None
        try:
            async for out in stream:
                rest.append(out)
        except RuntimeError as err:
            error = err
        return first, rest, error

    try:
        first, rest, error = asyncio.run(main())
    finally:
        runner.shutdown()
    assert len(first.token_ids) < 3 and len(rest) == 1 or len(first.token_ids) == 3 and not rest
    assert len((rest or [first])[-1].token_ids) == 3  # the tokens made before the failure, once
    assert error is not None and "engine failure" in str(error)


def test_a_stopped_engine_thread_refuses_new_work_and_answers_what_was_queued(base):
    """Requests and calls queued as the thread stopped were never answered (their callers
    waited forever); after shutdown, new ones are refused at once."""
    import pytest

    from kvshare.serve.driver.engine_thread import _Mailbox

    runner = AsyncEngine(LLMEngine(base, kv_cache_tokens=1024, block_size=8))
    runner.shutdown()

    async def main():
        with pytest.raises(RuntimeError, match="not running"):
            await runner.generate([5, 6, 7], SamplingParams(max_tokens=2)).__anext__()
        with pytest.raises(RuntimeError, match="not running"):
            await runner.call(lambda engine: 1)
        loop = asyncio.get_running_loop()
        stream, future = _Mailbox(), loop.create_future()
        runner._commands.put(("add", "late", None, [5], SamplingParams(), None, None, loop, stream))
        runner._commands.put(("call", None, lambda engine: 1, loop, future))
        runner._refuse_queued(RuntimeError("the server is shutting down"))
        item = await asyncio.wait_for(stream.get(), 5)
        with pytest.raises(RuntimeError, match="shutting down"):
            await asyncio.wait_for(future, 5)
        return item

    item = asyncio.run(main())
    assert isinstance(item, RuntimeError) and "shutting down" in str(item)
