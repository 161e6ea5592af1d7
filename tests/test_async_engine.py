"""The engine thread's delivery: a reader that stops reading holds one output, not one per token."""

from __future__ import annotations

import asyncio

from kvshare.serve import LLMEngine, SamplingParams
from kvshare.serve.async_engine import AsyncEngine

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
