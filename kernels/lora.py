"""Multi-adapter LoRA for a batch whose rows use different adapters: plain-torch reference.

Row r uses adapter ``index[r]`` (-1 = none); the result is ``scale * (x A^T) B^T`` per row,
computed per adapter over that adapter's rows, so each adapter's math is exactly PEFT's
``lora_B(lora_A(x)) * scaling`` whatever else shares the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lora_groups(slots: list[int], device: torch.device | str = "cpu") -> list[tuple[int, torch.Tensor]]:
    """(adapter slot, its row indices) for every slot used in a batch, from the host-side
    list of row slots (-1 = none); built once per step, so the device is never asked."""
    rows: dict[int, list[int]] = {}
    for row, slot in enumerate(slots):
        if slot >= 0:
            rows.setdefault(slot, []).append(row)
    return [(slot, torch.tensor(r, dtype=torch.long).to(device, non_blocking=True))
            for slot, r in sorted(rows.items())]


def gathered_lora_ref(x: torch.Tensor, base_out: torch.Tensor, groups: list[tuple[int, torch.Tensor]],
                      weights: list[tuple[torch.Tensor, torch.Tensor, float] | None]) -> torch.Tensor:
    """Add each row's adapter delta to ``base_out`` (rows, out); returns a new tensor.

    ``groups`` comes from :func:`lora_groups`; ``weights[a]`` is (A (r, in), B (out, r), scale)
    of adapter slot a, or None when that adapter does not adapt this projection.
    """
    out = base_out
    for slot, rows in groups:
        entry = weights[slot]
        if entry is None:
            continue
        a, b, scale = entry
        delta = F.linear(F.linear(x.index_select(0, rows), a), b) * scale
        out = out.index_add(0, rows, delta)  # out of place: base_out is left untouched
    return out
