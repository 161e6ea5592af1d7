"""vLLM's engine core: blocks of base K/V hashed as the base hashes them.

vLLM adds ``("lora", name, path)`` to the hash of every block of a LoRA request
(``generate_block_hash_extra_keys``), so no block is ever shared across adapters. For an
aLoRA or ICaRus request, the key is dropped from blocks that end at or before the activation
start (aLoRA: its invocation; ICaRus: never reached): their K/V were computed on base weights
(:mod:`.token_map`), so they are the base's blocks.
"""

from __future__ import annotations

from .kinds import request_activation_start



def _sharing_extra_keys(original):
    def generate_block_hash_extra_keys(request, start_token_idx: int, end_token_idx: int, start_mm_idx: int):
        keys, next_mm = original(request, start_token_idx, end_token_idx, start_mm_idx)
        start = request_activation_start(request)
        if keys is None or start is None or end_token_idx > start:
            return keys, next_mm
        kept = tuple(key for key in keys if not (isinstance(key, tuple) and key and key[0] == "lora"))
        return (kept or None), next_mm

    generate_block_hash_extra_keys.kvshare_patched = True
    return generate_block_hash_extra_keys


def install() -> None:
    from vllm.v1.core import block_pool, kv_cache_utils

    if getattr(kv_cache_utils.generate_block_hash_extra_keys, "kvshare_patched", False):
        return
    patched = _sharing_extra_keys(kv_cache_utils.generate_block_hash_extra_keys)
    modules = [kv_cache_utils, block_pool]  # block_pool imported the function by name
    try:
        from vllm.v1.simple_kv_offload import manager as offload_manager

        modules.append(offload_manager)
    except ImportError:
        pass
    for module in modules:
        module.generate_block_hash_extra_keys = patched
