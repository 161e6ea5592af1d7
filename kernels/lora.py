"""Multi-adapter LoRA for a batch whose rows use different adapters: plain-torch reference.

Row r uses adapter ``index[r]`` (-1 = none); the result is ``scale * (x A^T) B^T`` per row,
computed per adapter over that adapter's rows, so each adapter's math is exactly PEFT's
``lora_B(lora_A(x)) * scaling`` whatever else shares the batch. In a bfloat16 or float16
model the delta is accumulated in float32 and added to the projection's output with one
rounding (one ``addmm``), as PEFT does (it casts the sum back once) and the Triton, BGMV and
C++ kernels do; rounding the delta and the sum each to bfloat16 changed about a quarter of the
adapted values by a bfloat16 step. ``x A^T`` is rounded to the model's dtype, as vLLM's kernels
do (the BGMV and C++ kernels keep it in float32, as PEFT, the Triton segment kernels in TF32:
keeping it here costs a float32 pass over every adapted row's output, 3-9x the time of a
1.5k-row prompt's LoRA on 2 cores); the weights stay in the model's dtype, as vLLM keeps them
(PEFT upcasts them).
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
                      weights: list[tuple[torch.Tensor, torch.Tensor, float] | None],
                      inplace: bool = False) -> torch.Tensor:
    """Add each row's adapter delta to ``base_out`` (rows, out); returns a new tensor, or, with
    ``inplace``, ``base_out`` itself, updated.

    ``groups`` comes from :func:`lora_groups`; ``weights[a]`` is (A (r, in), B (out, r), scale)
    of adapter slot a, or None when that adapter does not adapt this projection.

    The engine passes ``inplace`` for a projection output it has just computed and nothing
    else holds: in an ICaRus prompt chunk (1k rows, one adapter row) a copy of the output per
    adapter and projection took 0.5-11 ms each, 38% of the chunk's time in the workflow bench,
    where the adapter's own math on its one row is microseconds. For the same reason the rows
    are added by gather, add, scatter: ``index_add_`` took 0.3-0.6 ms for one row of such an
    output inside the engine, against 0.03 ms this way (a group's rows are distinct).
    """
    out = base_out if inplace else None
    for slot, rows in groups:
        entry = weights[slot]
        if entry is None:
            continue
        a, b, scale = entry
        t = F.linear(x.index_select(0, rows), a)  # (rows, r)
        if out is None:
            out = base_out.clone()  # the one copy: base_out is left untouched
        # out + scale * t B^T in one GEMM: accumulated in float32, rounded once into the rows
        out.index_copy_(0, rows, torch.addmm(out.index_select(0, rows), t, b.T, alpha=scale))
    return base_out if out is None else out
