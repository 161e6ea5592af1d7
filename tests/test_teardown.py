"""leave_process_group frees DDP's reducer while the group is still alive, then the group."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from kvshare.loopback import free_port
from kvshare.train.teardown import leave_process_group


def test_the_reducer_is_freed_inside_and_the_group_destroyed(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    dist.all_gather_object([None], "a finished gather, as the trainer's last collective")
    reducer = weakref.ref(model.reducer)
    leave_process_group(model)
    assert reducer() is None  # freed here, not later by whoever drops the model
    assert not dist.is_initialized()
    assert model.module(torch.randn(1, 4)).shape == (1, 4)  # the wrapped module stays usable


def test_the_reducer_is_freed_after_accelerate_destroyed_the_group(monkeypatch):
    """accelerate's end_training() destroys the default group before the trainer leaves: the
    reducer still holds the group then, and must still be freed here (the CI hang's case)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    dist.destroy_process_group()
    reducer = weakref.ref(model.reducer)
    leave_process_group(model)
    assert reducer() is None


def test_without_a_group_it_does_nothing():
    model = torch.nn.Linear(4, 4)
    leave_process_group(model)
    assert not dist.is_initialized()
