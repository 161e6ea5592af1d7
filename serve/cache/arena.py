"""One KV memory for several co-located engines (SwiftCache's elastic cache).

The arena is a single byte buffer. Each engine sees the *whole* buffer as its own
block-major KV tensor ``(blocks, layers, 2, block_size, kv_heads, head_dim)`` in its own
dtype, so any block of the arena is addressable by any engine without a copy; which
engine may use which bytes is a matter of ownership only. Ownership moves in *exchange
units* of ``lcm`` of the engines' block sizes in bytes: a unit is a whole number of blocks
for every engine, so lending a unit hands over whole blocks and moves no data.

Each unit has a *home* engine (its share of a static partition) and a current *holder*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import KvshareError


@dataclass(frozen=True)
class BlockShape:
    """What one KV block of an engine holds: every layer's K and V of ``block_size`` tokens."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * self.dtype.itemsize

    def dims(self) -> tuple[int, ...]:
        return (self.layers, 2, self.block_size, self.kv_heads, self.head_dim)


class KVArena:
    def __init__(self, shapes: dict[str, BlockShape], home_bytes: dict[str, int],
                 device: torch.device | str = "cpu"):
        """``home_bytes``: each engine's share of the arena (its static partition), rounded
        down to whole exchange units."""
        if set(shapes) != set(home_bytes) or not shapes:
            raise KvshareError("the arena needs a block shape and a share for every engine")
        self.shapes = dict(shapes)
        self.unit_bytes = math.lcm(*(s.block_bytes for s in shapes.values()))
        # a share of 0 is deliberate (a layer-streaming engine keeps only a layer buffer locally)
        short = [name for name, share in home_bytes.items() if 0 < share < self.unit_bytes]
        if short:
            raise KvshareError(
                f"the engines' block sizes give an exchange unit of {self.unit_bytes / 2**20:.2f} MiB (the lcm "
                f"of {', '.join(str(s.block_bytes) for s in shapes.values())} bytes), more than the KV memory of "
                f"{', '.join(short)}: give it more KV memory, or pick block sizes whose byte sizes share more factors")
        home_units = {name: share // self.unit_bytes for name, share in home_bytes.items()}
        total = sum(home_units.values())
        if not total:
            raise KvshareError("the arena has no memory: give at least one engine a KV share")
        self.home: list[str] = [name for name, n in home_units.items() for _ in range(n)]
        self.holder: list[str] = list(self.home)
        self.memory = torch.zeros(total * self.unit_bytes, dtype=torch.uint8, device=device)
        self.units_moved = 0

    @property
    def num_units(self) -> int:
        return len(self.home)

    def blocks_per_unit(self, name: str) -> int:
        return self.unit_bytes // self.shapes[name].block_bytes

    def view(self, name: str) -> torch.Tensor:
        """The whole arena as ``name``'s block-major KV tensor (no copy)."""
        shape = self.shapes[name]
        blocks = self.num_units * self.blocks_per_unit(name)
        return self.memory.view(shape.dtype).view(blocks, *shape.dims())

    def blocks(self, name: str, unit: int) -> list[int]:
        """``name``'s block ids that cover exchange unit ``unit``."""
        per = self.blocks_per_unit(name)
        return list(range(unit * per, (unit + 1) * per))

    def units_held(self, name: str) -> list[int]:
        return [u for u, holder in enumerate(self.holder) if holder == name]

    def owned_blocks(self, name: str) -> list[int]:
        return [b for u in self.units_held(name) for b in self.blocks(name, u)]

    def move(self, unit: int, to: str) -> None:
        """Hand a unit to another engine: ownership only, no bytes move."""
        self.holder[unit] = to
        self.units_moved += 1

    def byte_range(self, name: str, block_id: int) -> tuple[int, int]:
        size = self.shapes[name].block_bytes
        return block_id * size, (block_id + 1) * size
