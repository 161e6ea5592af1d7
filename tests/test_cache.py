"""The cache package on its own: pool, prefix index, eviction policy, block manager."""

from __future__ import annotations

import pytest

from kvshare.errors import KvshareError
from kvshare.kinds import AdapterKind, kind_spec
from kvshare.serve.cache import BlockManager, LRUPolicy, OutOfBlocks, PrefixPending, make_policy
from kvshare.serve.sampling_params import SamplingParams
from kvshare.serve.sequence import Sequence

BS = 2


def seq(tokens, kind=None, digest=None, name="s"):
    s = Sequence(name, list(tokens), SamplingParams(max_tokens=1))
    s.spec, s.adapter_digest = kind_spec(kind), digest
    return s


def finish_prefill(manager, s):
    s.num_computed = len(s)
    manager.register_computed(s)


def test_prefix_hits_follow_the_kind_and_the_digest():
    m = BlockManager(16, BS, "sha256:base")
    a = seq([1, 2, 3, 4, 5])
    m.allocate(a)
    finish_prefill(m, a)
    m.free(a)
    icarus = seq([1, 2, 3, 4, 9], AdapterKind.ICARUS, "sha256:x")
    m.allocate(icarus)
    assert icarus.num_computed == 4  # base KV: shared with ICaRus
    m.free(icarus)
    lora = seq([1, 2, 3, 4, 9], AdapterKind.LORA, "sha256:x")
    m.allocate(lora)
    assert lora.num_computed == 0  # never the base's KV
    finish_prefill(m, lora)
    m.free(lora)
    same = seq([1, 2, 3, 4], AdapterKind.LORA, "sha256:x")
    m.allocate(same)
    assert same.num_computed == 4
    m.free(same)
    other = seq([1, 2, 3, 4], AdapterKind.LORA, "sha256:y")
    m.allocate(other)
    assert other.num_computed == 0  # another digest: another owner
    assert m.stats.hit_tokens == 8


def test_lru_evicts_the_least_recently_released_block_and_counts_it():
    m = BlockManager(4, BS, "sha256:base")
    first, second = seq([1, 2, 3, 4], name="a"), seq([5, 6, 7, 8], name="b")
    for s in (first, second):
        m.allocate(s)
        finish_prefill(m, s)
    m.free(first)
    m.free(second)
    assert m.num_free == 4 and m.usage()["blocks_cached_idle"] == 4
    third = seq([9, 10, 11], name="c")
    m.allocate(third)  # needs 2 blocks: first's two go
    assert m.stats.evictions == 2
    again = seq([5, 6, 7, 8], name="d")
    m.allocate(again)
    assert again.num_computed == 4  # second's blocks survived


def test_allocation_is_all_or_nothing_and_pending_prefixes_wait():
    m = BlockManager(3, BS, "sha256:base")
    big = seq(range(10))
    with pytest.raises(OutOfBlocks):
        m.allocate(big)
    assert m.num_free == 3 and big.block_table == []
    a, b = seq([1, 2, 3], name="a"), seq([1, 2, 3], name="b")
    m.allocate(a)
    with pytest.raises(PrefixPending):  # a computes the block b would reuse
        m.allocate(b)
    finish_prefill(m, a)
    m.allocate(b)
    assert b.num_computed == 2


def test_policy_interface_and_names():
    policy = LRUPolicy()
    for block in (3, 1, 2):
        policy.add(block)
    policy.remove(1)
    assert len(policy) == 2 and 3 in policy and policy.pop_victim() == 3
    assert isinstance(make_policy("lru"), LRUPolicy)
    with pytest.raises(KvshareError, match="unknown eviction policy"):
        make_policy("fifo-that-does-not-exist")


def test_reset_refuses_while_blocks_are_held():
    m = BlockManager(4, BS, "sha256:base")
    s = seq([1, 2, 3])
    m.allocate(s)
    with pytest.raises(RuntimeError):
        m.reset()
    m.free(s)
    m.reset()
    assert m.stats.queried_tokens == 0 and m.num_free == 4
