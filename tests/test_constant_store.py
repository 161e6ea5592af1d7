"""Packed constants of the compiled step's cache entries kept once on disk
(``serve/exec/constant_store.py``): an entry names them, loading gives the tensor back, equal
constants of two entries are one file and one tensor, and a missing file is a cache miss."""

from __future__ import annotations

import pickle

import pytest
import torch

from kvshare.errors import KvshareError
from kvshare.serve.exec.constant_store import stored_entry_constants
from kvshare.serve.exec.shared_constants import MIN_BYTES


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path / "inductor" / "kvshare-constants"


def test_an_entry_names_its_large_constants_and_loads_them_back(store):
    packed = torch.randn(MIN_BYTES // 4 // 16, 16)
    small = torch.ones(4)
    entry = pickle.dumps({"constants": stored_entry_constants({"packed": packed, "small": small})})
    assert len(entry) < packed.numel() * 4 // 4  # the bytes are not in the entry
    assert len(list(store.glob("*.safetensors"))) == 1
    loaded = pickle.loads(entry)["constants"]
    assert torch.equal(loaded["packed"], packed) and loaded["packed"].dtype == packed.dtype
    assert torch.equal(loaded["small"], small)  # pickled in the entry as before


def test_two_entries_with_an_equal_constant_share_one_file_and_one_tensor(store):
    packed = torch.randn(MIN_BYTES // 2 // 32, 32).bfloat16()
    first = pickle.dumps(stored_entry_constants({"constant1": packed}))
    second = pickle.dumps(stored_entry_constants({"constant7": packed.clone()}))
    assert len(list(store.glob("*"))) == 1  # (no partial file left either)
    a, b = pickle.loads(first), pickle.loads(second)
    assert a["constant1"] is b["constant7"] and torch.equal(a["constant1"], packed)


def test_an_entry_whose_constant_is_gone_does_not_load(store):
    entry = pickle.dumps(stored_entry_constants({"packed": torch.randn(MIN_BYTES // 4)}))
    for path in store.glob("*.safetensors"):
        path.unlink()
    with pytest.raises(KvshareError, match="missing"):
        pickle.loads(entry)
