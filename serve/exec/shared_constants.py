"""One copy of each constant that several compiled graphs made alike.

Why our own code: Inductor's CPU GEMM template packs each graph's projection weights into a
blocked copy of its own (frozen constants, module globals of the graph's generated code). Its
blocking does not depend on the row count, so the copies of every bucket, with adapters or not,
are equal byte for byte: about 400 MB per SmolLM2 float32 graph, eight graphs for the default
buckets. Inductor has no setting to share them, so after each compile :func:`share_constants`
points the new graph's constants that equal an earlier graph's at that one, and the copy is freed.

Only the graphs' read-only constants are touched, never a tensor anything else holds (a model
parameter frozen as it is), and only where the earlier tensor has the same dtype, shape and
strides and is equal element for element.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref
from types import ModuleType

import torch

MIN_BYTES = 1 << 16  # smaller constants (norm weights, biases) are not worth a comparison
_SAMPLE = 4096  # elements read for a constant's fingerprint; equality is checked in full

_canonical: dict[tuple, list[weakref.ref]] = {}  # fingerprint -> constants kept, across engines
_lock = threading.Lock()


def return_freed_memory(collect: bool = True) -> None:
    """Free what a compile left behind and hand the heap's free pages back to the system (glibc's
    ``malloc_trim``): the copies dropped and the compile's own scratch otherwise stay resident,
    and the next compile's peak starts from there. The collection comes first: the frozen graph
    a compile lowers sits in reference cycles, holding the weights as the freezing pass
    prepacked them for oneDNN/MKL, which the GEMM template's graph never reads (it packs its own
    copy); they waited for Python's next full collection (SmolLM2 float32, 2 graphs, a 2-vCPU
    Xeon: RSS 3199 MB before, 2508 MB after). The trim is a no-op where the C library is not glibc.
    ``collect=False``: the trim alone (a full collection holds Python's lock for about 0.3 s)."""
    if collect:
        gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own C library
    if trim is not None:  # (not glibc, e.g. macOS or musl: its allocator keeps its own policy)
        trim(0)


def graph_modules() -> list[ModuleType]:
    """Inductor's loaded generated-code modules, in load order (what :func:`share_constants` takes
    the new ones of)."""
    from torch._inductor.codecache import PyCodeCache

    return list(PyCodeCache.modules)


def _fingerprint(t: torch.Tensor) -> tuple:
    flat = t.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // _SAMPLE)]
    raw = sample.contiguous().cpu().view(torch.uint8)  # (bytes: numpy has no bfloat16)
    return t.dtype, tuple(t.shape), t.stride(), t.device, hash(raw.numpy().tobytes())


def shareable(value: object) -> bool:
    """A constant worth comparing: a plain tensor of at least :data:`MIN_BYTES`, not trained."""
    return (isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.requires_grad
            and value.numel() * value.element_size() >= MIN_BYTES)


def _earlier_equal(t: torch.Tensor) -> torch.Tensor | None:
    """The kept constant equal to ``t`` (keeping ``t`` when there is none)."""
    refs = _canonical.setdefault(_fingerprint(t), [])
    refs[:] = [r for r in refs if r() is not None]
    for ref in refs:
        kept = ref()
        if kept is not None and kept is not t and torch.equal(kept, t):
            return kept
    if not any(ref() is t for ref in refs):
        refs.append(weakref.ref(t))
    return None


def share_constants(modules: list[ModuleType]) -> int:
    """Point the constants of ``modules`` (graphs just loaded) that equal an earlier graph's at
    that one, in the module and in the compiled graph's own record of its constants (a dict
    naming it as the module does). A tensor that anything else holds (a model's parameter that
    the graph froze as it is) is left alone. Returns the bytes no longer held twice."""
    with _lock:
        copies, name, kept = _copies(modules)
        if not copies:
            return 0
        graph_dicts = {id(vars(m)) for m in modules}
        holders = [h for h in gc.get_referrers(*copies) if h is not copies]
        foreign = {id(v) for h in holders for v in _held(h) if id(v) in name and not (
            isinstance(h, dict) and (id(h) in graph_dicts or h.get(name[id(v)]) is v))}
        for holder in holders:
            for key, value in list(holder.items()) if isinstance(holder, dict) else ():
                if id(value) in name and id(value) not in foreign and key == name[id(value)]:
                    holder[key] = kept[id(value)]
        return sum(c.numel() * c.element_size() for c in copies if id(c) not in foreign)


def _copies(modules: list[ModuleType]) -> tuple[list[torch.Tensor], dict[int, str], dict[int, torch.Tensor]]:
    """The constants of ``modules`` equal to one kept before, their names in their module, and
    the kept one for each (by ``id``); every other shareable constant is kept from now on."""
    copies, name, kept = [], {}, {}
    for module in modules:
        for key, value in vars(module).items():
            if shareable(value) and id(value) not in name:
                earlier = _earlier_equal(value)
                if earlier is not None:
                    copies.append(value)
                    name[id(value)], kept[id(value)] = key, earlier
    return copies, name, kept


def _held(holder: object) -> list:
    """What a referrer holds: a dict's values, a sequence's items (anything else: unknown)."""
    if isinstance(holder, dict):
        return list(holder.values())
    if isinstance(holder, (list, tuple)):
        return list(holder)
    return list(gc.get_referents(holder))
