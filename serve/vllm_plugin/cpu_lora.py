"""vLLM's CPU LoRA kernels, fixed for tokens without an adapter.

``vllm.lora.ops.torch_ops`` picks each token's A matrix with ``lora_a[indices]``, and the
index of "no adapter" is -1, which Python reads as the last slot: in a batch that also holds
an adapter, a base token gets that adapter's delta (vLLM 0.32; upstream fixes are open). The
shrink step is wrapped so those tokens' rows are zero, and the expand step then adds nothing.
"""

from __future__ import annotations

import torch


def _zero_unadapted(shrink):
    def shrink_without_negative_slots(inputs: torch.Tensor, lora_a: torch.Tensor, output: torch.Tensor,
                                      indices: torch.Tensor, scaling: float = 1.0) -> None:
        shrink(inputs, lora_a, output, indices, scaling)
        unadapted = indices[: output.shape[0]] < 0
        if bool(unadapted.any()):
            output[: unadapted.shape[0]][unadapted] = 0

    shrink_without_negative_slots.kvshare_patched = True
    return shrink_without_negative_slots


def install() -> None:
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops.bgmv_shrink, "kvshare_patched", False):
        return
    fixed = _zero_unadapted(lora_ops.bgmv_shrink)
    for module in (lora_ops, torch_ops, punica_cpu):  # sgmv_shrink calls lora_ops' bgmv_shrink
        module.bgmv_shrink = fixed
