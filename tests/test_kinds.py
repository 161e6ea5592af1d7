"""Kind specs: each kind's serving behaviour in one place, checked against the rules of
BRIEF.md restated by hand."""

from __future__ import annotations

import pytest

from kvshare.errors import KvshareError
from kvshare.kinds import BASE, KINDS, AdapterKind, ShareScope, kind_spec


def test_scope_follows_from_where_the_adapter_computes_kv():
    assert kind_spec("lora").scope is ShareScope.NONE and kind_spec("icarus").scope is ShareScope.ALL
    assert kind_spec(AdapterKind.ALORA).scope is ShareScope.BEFORE_INVOCATION and kind_spec(None) is BASE
    # lora: every block is the adapter's; icarus and base: none is; alora: from the invocation on
    assert [KINDS[AdapterKind.LORA].kv_owner("d", end, None) for end in (1, 8)] == ["d", "d"]
    assert KINDS[AdapterKind.ICARUS].kv_owner("d", 8, None) is None and BASE.kv_owner(None, 8, None) is None
    alora = KINDS[AdapterKind.ALORA]
    assert [alora.kv_owner("d", end, 4) for end in (3, 4, 5, 9)] == [None, None, "d", "d"]
    assert alora.kv_owner("d", 9, None) is None  # no invocation in the prompt: the base's KV


def test_paired_rows_only_where_query_and_kv_weights_differ():
    icarus, lora, alora = (kind_spec(k) for k in ("icarus", "lora", "alora"))
    assert icarus.base_kv_only and not lora.base_kv_only and not alora.base_kv_only
    for pos in range(6):
        assert icarus.kv_from_adapter(pos) is False and icarus.query_from_adapter(pos) is True
        assert lora.kv_from_adapter(pos) == lora.query_from_adapter(pos)
        assert alora.kv_from_adapter(pos, 3) == alora.query_from_adapter(pos, 3) == (pos >= 3)


def test_targets_and_layout():
    assert set(kind_spec("icarus").forbidden_targets) == {"k_proj", "v_proj"}
    assert not set(kind_spec("icarus").default_targets) & {"k_proj", "v_proj"}
    assert kind_spec("alora").needs_invocation and not kind_spec("lora").needs_invocation
    with pytest.raises(KvshareError, match="unknown adapter kind 'prefix'"):
        kind_spec("prefix")
