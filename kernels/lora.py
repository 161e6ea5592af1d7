"""Multi-adapter LoRA for a batch whose rows use different adapters: plain-torch reference.

Row r uses adapter ``index[r]`` (-1 = none); the result is ``scale * (x A^T) B^T`` per row,
computed per adapter over that adapter's rows, so each adapter's math is exactly PEFT's
``lora_B(lora_A(x)) * scaling`` whatever else shares the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gathered_lora_ref(x: torch.Tensor, base_out: torch.Tensor, index: torch.Tensor,
                      weights: list[tuple[torch.Tensor, torch.Tensor, float] | None]) -> torch.Tensor:
    """Add each row's adapter delta to ``base_out`` (rows, out) and return it.

    ``weights[a]`` is (A (r, in), B (out, r), scale) of adapter slot a, or None when that
    adapter does not adapt this projection.
    """
    if index.numel() == 0 or bool((index < 0).all()):
        return base_out
    out = base_out.clone()
    for slot in torch.unique(index[index >= 0]).tolist():
        entry = weights[slot]
        if entry is None:
            continue
        a, b, scale = entry
        rows = index == slot
        out[rows] = base_out[rows] + F.linear(F.linear(x[rows], a), b) * scale
    return out
