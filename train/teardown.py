"""Leaving the process group at the end of a DDP run without gloo's teardown deadlock.

Why this exists: DDP's C++ reducer holds the process group, and its Python binding frees it with
the GIL held. When the reducer is the group's last holder, ``~ProcessGroupGloo`` then joins gloo's
worker threads under the GIL, while a worker that is still freeing a finished collective (the
final gather's tensors) waits for the GIL to drop their Python objects: both wait forever. Seen in
about one two-node run in ten on loopback (py-spy: main thread in ``Reducer`` dealloc ->
``ProcessGroupGloo::~ProcessGroupGloo`` -> ``thread::join``; worker in ``~AsyncAllgatherWork`` ->
``gil_scoped_acquire``). torch's own ProcessGroup binding releases the GIL before freeing, so the
fix is order: free the reducer first, while a Python reference (the DDP module's
``process_group``, and ours) still keeps the group alive. accelerate's ``end_training()`` has
usually destroyed the default group already by then, which does not free it: the reducer and
that attribute still hold it.
"""

from __future__ import annotations

import gc

import torch


def leave_process_group(model: torch.nn.Module) -> None:
    """Free ``model``'s DDP reducer while the group is still held from Python, then destroy the
    default process group if it is still up. Anything but a DDP model passes through."""
    group = getattr(model, "process_group", None)  # a Python reference: its release lets go of the GIL
    for name in ("logger", "reducer"):  # the reducer's holders in DistributedDataParallel
        if hasattr(model, name):
            delattr(model, name)
    gc.collect()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    del group
