"""Inductor's on-disk FX graph cache for the compiled CPU step, keyed by the weights' bytes.

Why our own code: Inductor (torch 2.13) does not cache a graph whose frozen weights it packed
for oneDNN ("mkldnn tensors unpickleable"), although those tensors never go into the cache
entry: a frozen graph's entry names its frozen parameters and takes them from the live module
when it loads. So every process lowered every bucket again (about 25 s of a 32 s compile per
SmolLM2 graph on 2 cores). Lifting that refusal alone would be unsafe: the key names frozen
weights by shape and dtype only, while the entry stores what the C++ GEMM template packed
from their values, so a second model of the same shape would load the first one's weights.

:func:`cache_frozen_graphs` lifts the refusal for frozen oneDNN parameters of graphs compiled
with a :class:`WeightsKey` only (anything else unpicklable, and every other torch.compile in
the process, keeps Inductor's rule), and :class:`WeightsKey` puts a digest of every frozen tensor's
bytes into the key, through Inductor's documented extension point for it (a custom pass's
``uuid``; the pass itself does nothing). The packed copy of the weights an entry would hold
(258 MB per SmolLM2 bfloat16 graph, alike in every bucket) goes to :mod:`.constant_store`
instead, once per content, and the entry names it. The patch checks the internals it replaces and leaves
Inductor as it is where they differ (another torch): graphs then compile as before.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import logging
import sys

import torch

log = logging.getLogger(__name__)


def weights_digest(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """A digest of the named tensors' names, dtypes, shapes and bytes (what a graph freezes)."""
    h = hashlib.blake2b(digest_size=20)
    for name, tensor in tensors:
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        flat = tensor.detach().contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
    return h.hexdigest()


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - a torch without it; the pin has it
    CustomGraphPass = object


class WeightsKey(CustomGraphPass):
    """A post-grad pass that changes nothing: its ``uuid`` (the weights' digest) is part of
    Inductor's cache key, so an entry only loads for the very weights it was packed from."""

    def __init__(self, digest: str):
        self.digest = digest

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return f"kvshare-weights-{self.digest}"


@functools.cache
def cache_frozen_graphs() -> bool:
    """Let Inductor's FX graph cache take graphs with frozen oneDNN weights that a
    :class:`WeightsKey` keys (patched once per process). False where this torch's internals are
    not the ones patched (nothing is changed then)."""
    try:
        from torch._inductor import codecache, config
        from torch._inductor.freezing_utils import is_frozen_param
        from torch._inductor.output_code import CompiledFxGraph
        validator, pickler = codecache.CacheabilityValidator, codecache.FxGraphCachePickler
        check_tensor, reduce_tensor, ident = validator.check_tensor, pickler._reduce_tensor, codecache._ident
        prepare_for_serialization = CompiledFxGraph.prepare_for_serialization
        from .constant_store import stored_entry_constants  # (it digests with weights_digest, from here)
    except (ImportError, AttributeError) as err:
        log.info("kvshare: Inductor's graph cache stays as it is (%s)", err)
        return False
    if CustomGraphPass is object:
        return False

    def frozen_mkldnn(t: torch.Tensor) -> bool:
        # only in graphs keyed by their weights (ours): another torch.compile in the process
        # keeps Inductor's own rule
        return t.is_mkldnn and is_frozen_param(t) and isinstance(config.post_grad_custom_post_pass, WeightsKey)

    def check(t: torch.Tensor) -> None:
        if not frozen_mkldnn(t):
            check_tensor(t)

    def reduce(self, t: torch.Tensor):
        # a frozen parameter is keyed by its metadata (the weights themselves by WeightsKey);
        # a oneDNN tensor has no strides to extract
        if frozen_mkldnn(t):
            return ident, (("frozen mkldnn tensor", str(t.dtype), tuple(t.shape)),)
        return reduce_tensor(self, t)

    def prepare(self) -> None:
        # the large constants of our graphs' entries go to the store, once per content
        prepare_for_serialization(self)
        if self.constants and isinstance(config.post_grad_custom_post_pass, WeightsKey):
            self.constants = stored_entry_constants(self.constants)

    validator.check_tensor = staticmethod(check)
    pickler._reduce_tensor = reduce
    CompiledFxGraph.prepare_for_serialization = prepare
    return True


def release_compiled_graphs() -> None:
    """Free every compiled graph of this process, for a process that makes engines one after
    another (the benchmarks): call it once the old engine is gone. Why: Dynamo's caches keep
    each graph, and Inductor's loaded modules, each graph's packed weights attached, stay in
    ``sys.modules``, so an engine's graphs outlived it (about 0.5 GB per SmolLM2 graph; a
    benchmark of three engines with 128-row buckets reached 15 GB while its second engine compiled). An engine still alive
    compiles its graphs again at its next step (loading them from the on-disk cache)."""
    import torch._dynamo
    from torch._inductor.codecache import PyCodeCache

    torch._dynamo.reset()
    for module in PyCodeCache.modules:
        if sys.modules.get(module.__name__) is module:
            del sys.modules[module.__name__]
    PyCodeCache.cache_clear(purge=False)
    gc.collect()
