"""The sizes of the models whose shapes the kernel benchmarks and the offline compile use:
SmolLM2-135M (what our machines run) and Llama-3-8B (what a GPU user serves)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The attention and projection sizes of one model."""

    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int


SHAPES = {
    "smollm2-135m": Shape(q_heads=9, kv_heads=3, head_dim=64, hidden=576, intermediate=1536),
    "llama-8b": Shape(q_heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336),
}
