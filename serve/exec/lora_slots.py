"""Resident adapters' LoRA weights in fixed slot stacks: what the compiled CPU step reads.

The compiled step is one graph per batch bucket, and adapters come and go at run time, so
their weights cannot be frozen into it; called from the graph one adapter at a time
(an opaque op per fused projection, 120 calls per step for SmolLM2) their deltas cost as much as
the rest of an ICaRus paired step. vLLM's layout instead: per projection one stack of A
``(layers, max_loras, rank, in)`` and one of B, stored transposed ``(layers, max_loras,
rank, out)``, zero-padded to the stacks' rank (zeros add exact zeros), handed to the graph
as inputs. Each row picks its slot's weights by index, so every row of a step, with any mix
of adapters, is one fused reduction per projection inside the graph; a row without adapter
takes slot 0 with scale 0. Where the projections run in dot products (bfloat16 decode buckets,
:mod:`kvshare.kernels.cpu.linear`), the deltas run inside that op instead, in the same pass over
the weight, and rows of scale 0 skip them.

As in vLLM, ``max_loras`` bounds the adapters of one step, not the adapters loaded: a step's
adapters are brought into the stacks when it runs (:meth:`LoraSlots.serves`), each into a free
slot or the one least recently read by a step, and the scheduler keeps a step's adapters within
``max_loras`` (:class:`~..engine.scheduler.Scheduler`). Why: slots fixed by load order left every adapter
past the 8th on the eager step: 16 ICaRus agents decoding together ran every step eager, at
3.2x the base's step, and run 2.9x faster with 8 slots swapped as now
(results/workflow-e2e/session32-spr/pair_steps.txt, many_agents.txt). Rewriting a slot copies
one adapter's A and B. Loading, unloading or swapping an adapter rewrites slots in place:
the graph stays, unless the stacks' rank has to grow (the next power of two of the largest rank,
at least 8, at most ``max_rank``). Adapters of a rank past ``max_rank``, or with several scales,
run on the eager step.

Only the projections some adapter adapts get deltas (:attr:`LoraSlots.parts`): ICaRus
adapters leave k/v to the base, so their graph skips 2 of 7 projections' reductions (in an
8-pair decode step at 2k context the step's time outside attention went from 26.5 to 24.7
ms). A projection left out is handed to the graph as a rank-0 stack, so the graph knows it
when traced. The set only grows (a new projection compiles the graphs with
adapters again, as a rank increase does; a set that shrank and grew back would compile on
every change), and starts from every projection where the graph is compiled before any
adapter is loaded.
"""

from __future__ import annotations

import logging

import torch

from .adapters import AdapterSet, LoadedAdapter

log = logging.getLogger(__name__)

PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIN_RANK = 8


def _stack_rank(rank: int, max_rank: int) -> int:
    size = MIN_RANK
    while size < rank:
        size *= 2
    return min(size, max_rank)


def _adapted_parts(adapter: LoadedAdapter) -> set[str]:
    """The projections whose stacks take ``adapter``'s weights: a ForkKV adapter's k/v LoRA
    goes to its residual pool, never into K/V (as ``AdapterSet._fuse``)."""
    skip = adapter.layout.residual_projections
    return {name for _, name in adapter.weights if name in PARTS and name not in skip}


def _single_scale(adapter: LoadedAdapter) -> float | None:
    scales = {scale for _, _, scale in adapter.weights.values()}
    return scales.pop() if len(scales) == 1 else None


class LoraSlots:
    """The stacks of one engine's compiled step, refreshed from its :class:`AdapterSet`."""

    def __init__(self, model, max_loras: int, max_rank: int):
        self.model = model
        self.max_loras, self.max_rank = max_loras, max_rank
        hidden = model.config.hidden_size
        sizes = dict(part for parts in model.fused.values() for part in parts)  # name -> output size
        inputs = {"o_proj": model.q_size, "down_proj": model.inter}
        self.shapes = {name: (inputs.get(name, hidden), sizes[name]) for name in PARTS}
        self.rank = 0  # the stacks' rank; 0 = not allocated
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scales: list[float] = []  # per stack slot; 0 where the slot is empty
        self.servable: dict[int, LoadedAdapter] = {}  # adapter (its AdapterSet slot) -> weights, those the stacks take
        self.resident: dict[int, int] = {}  # adapter -> the stack slot holding it now
        self.last_used: list[int] = []  # per stack slot: the step that last read it
        self.swaps = 0  # adapters written into a stack slot for a step that needed them
        self.parts: tuple[str, ...] = ()  # projections the graph adapts, in PARTS order
        self._version = -1
        self._steps = 0

    def fits(self, adapter: LoadedAdapter | None) -> bool:
        """Whether the stacks can take ``adapter`` (its rank, one scale for all its weights)."""
        return adapter is not None and adapter.rank <= self.max_rank and _single_scale(adapter) is not None

    def serves(self, adapters) -> bool:
        """Whether one step may read ``adapters`` (AdapterSet slots) from the stacks: each one
        they take, at most ``max_loras`` of them (after :meth:`sync`). Those not held yet are
        written in now, into free slots or those least recently read by a step."""
        wanted = set(adapters)
        if len(wanted) > self.max_loras or not wanted <= self.servable.keys():
            return False
        self._steps += 1
        taken = {self.resident[a] for a in wanted if a in self.resident}
        free = sorted(set(range(self.max_loras)) - set(self.resident.values()))
        spare = sorted((i for i in self.resident.values() if i not in taken), key=self.last_used.__getitem__)
        holder = {i: a for a, i in self.resident.items()}
        for adapter in sorted(wanted - self.resident.keys()):
            index = free.pop(0) if free else spare.pop(0)
            self.resident.pop(holder.pop(index, None), None)
            self._write(index, self.servable[adapter])
            self.resident[adapter] = index
            self.swaps += 1
        for adapter in wanted:
            self.last_used[self.resident[adapter]] = self._steps
        return True

    def sync(self, adapters: AdapterSet) -> bool:
        """Take the set's adapters as they are now (the stacks are refilled as steps need them);
        True when the stacks were reallocated (a new rank: the graphs that read them compile again)."""
        if adapters.version == self._version:
            return False
        self.servable = {slot: a for slot, a in enumerate(adapters.slots) if self.fits(a)}
        grown = False
        if self.servable:
            grown = self.allocate(max(a.rank for a in self.servable.values()))
            grown = self.adapt_parts(set().union(*map(_adapted_parts, self.servable.values()))) or grown
        self._clear()
        self._version = adapters.version
        return grown

    def _clear(self) -> None:
        """No adapter held: each slot is written again by the next step that needs it."""
        self.scales = [0.0] * self.max_loras
        self.resident = {}
        self.last_used = [0] * self.max_loras

    def allocate(self, rank: int = MIN_RANK) -> bool:
        """Stacks of at least ``rank`` (rounded up as the module says); True when (re)allocated."""
        rank = _stack_rank(rank, self.max_rank)
        if rank <= self.rank:
            return False
        if self.rank:
            log.warning("kvshare: LoRA slot stacks grow to rank %d: the CPU step's graphs with adapters "
                        "compile again", rank)
        m = self.model
        zeros = lambda *shape: torch.zeros(*shape, dtype=m.dtype, device=m.embed.device)  # noqa: E731
        self.stacks = {name: (zeros(m.n_layers, self.max_loras, rank, n_in),
                              zeros(m.n_layers, self.max_loras, rank, n_out))
                       for name, (n_in, n_out) in self.shapes.items()}
        self.rank = rank
        self._clear()
        return True

    def adapt_parts(self, parts: set[str]) -> bool:
        """Add ``parts`` to the projections the graph adapts; True when the set grew."""
        if parts <= set(self.parts):
            return False
        self.parts = tuple(name for name in PARTS if name in parts or name in self.parts)
        return True

    def _write(self, slot: int, adapter: LoadedAdapter | None) -> None:
        adapted = _adapted_parts(adapter) if adapter is not None else set()
        for name, (a_stack, b_stack) in self.stacks.items():
            a_stack[:, slot].zero_()
            b_stack[:, slot].zero_()
            if name not in adapted:
                continue
            for layer in range(self.model.n_layers):
                entry = adapter.weights.get((layer, name))
                if entry is not None:
                    a, b, _ = entry
                    a_stack[layer, slot, :a.shape[0]] = a
                    b_stack[layer, slot, :b.shape[1]] = b.T
        if adapter is not None:
            self.scales[slot] = _single_scale(adapter)

    def inputs(self) -> list[torch.Tensor]:
        """The stacks as the graph takes them: A and B of each of :data:`PARTS`, in order; rank 0
        for a projection not in :attr:`parts`."""
        return [t for name in PARTS for t in (self.stacks[name] if name in self.parts else self._unadapted(name))]

    def _unadapted(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.stacks[name]
        return a[:, :, :0], b[:, :, :0]

    def row_inputs(self, groups: list[tuple[int, torch.Tensor]], size: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each of ``size`` rows' stack slot and scale (0 and 0.0: no adapter, pad rows;
        :func:`lora_delta` gives those rows zeros). ``groups``: (AdapterSet slot, rows) of
        adapters :meth:`serves` took for this step."""
        index = torch.zeros(size, dtype=torch.long, device=device)
        scale = torch.zeros(size, dtype=torch.float32, device=device)
        for adapter, rows in groups:
            held = self.resident[adapter]
            index.index_fill_(0, rows, held)
            scale.index_fill_(0, rows, self.scales[held])
        return index, scale


def lora_delta(x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, index: torch.Tensor,
               scale: torch.Tensor) -> torch.Tensor:
    """Each row's ``scale * (x A^T) B^T`` with its own slot's A ``(slots, r, in)`` and B^T
    ``(slots, r, out)``: inside a graph, two reductions that read the slots in place. Rank-0
    stacks (a projection no adapter adapts) give zeros, and no reduction in a traced graph.
    In float32 whatever ``x``'s dtype, for the caller to add to the projection and round once
    (PEFT's float32 adapter math; :func:`kvshare.kernels.lora.gathered_lora_ref`)."""
    wide = torch.promote_types(x.dtype, torch.float32)
    if a.shape[-2] == 0:
        return x.new_zeros(x.shape[0], b_t.shape[-1], dtype=wide)
    t = (a[index].to(wide) * x.to(wide)[:, None, :]).sum(-1)  # (rows, r)
    delta = (b_t[index].to(wide) * t[:, :, None]).sum(1)  # (rows, out)
    # rows of no adapter read slot 0: exact zeros for them, whatever slot 0 holds (a NaN in
    # one tenant's adapter must not reach the base rows, nor the base KV they write)
    return torch.where(scale[:, None] != 0, delta * scale[:, None], 0.0)
