"""kvshare's vLLM plugin: ICaRus and aLoRA adapters in vLLM, sharing the base's KV blocks.

vLLM loads it through the ``vllm.general_plugins`` entry point in each of its processes (the
API server, the engine core, every worker) when kvshare is installed beside it. Requests
without an ICaRus or aLoRA adapter run as vLLM runs them; for the others:

- the worker accepts a PEFT folder with ``alora_invocation_tokens`` (vLLM refuses it), and
  each token whose K/V the base computes (aLoRA: before the invocation's start, PEFT's rule;
  ICaRus: every token) gets no adapter in vLLM's per-token map (:mod:`.token_map`);
- ICaRus tokens run a second stream that reads the cache and writes nothing, and give their
  logits from it (:mod:`.icarus`: the model class that replaces vLLM's ``LlamaForCausalLM``);
- in the engine core, prefix-cache blocks of base K/V are hashed as the base hashes them, so
  they are shared across the base and these adapters; the rest keep vLLM's per-adapter key
  (:mod:`.block_hashes`).

It also fixes vLLM's CPU LoRA kernels, which give a token with no adapter (slot -1) the
adapter in the last slot (:mod:`.cpu_lora`): without that, a base token beside a LoRA request
in one batch is computed wrongly, and so is every base-K/V token of the kinds above.

Written for vLLM 0.32 (``SUPPORTED``); on another version it logs a warning and stays off,
since it patches vLLM's internals.
"""

from __future__ import annotations

import logging

SUPPORTED = ("0.32.",)
logger = logging.getLogger("kvshare.vllm")
_registered = False


def register() -> None:
    """The entry point vLLM calls in each process; idempotent."""
    global _registered
    if _registered:
        return
    import vllm

    if not vllm.__version__.startswith(SUPPORTED):
        logger.warning("kvshare's vLLM plugin supports vLLM %s, not %s: it stays off (aLoRA adapters are "
                       "refused by vLLM as usual)", "/".join(v + "x" for v in SUPPORTED), vllm.__version__)
        return
    from . import block_hashes, cpu_lora, icarus, token_map

    cpu_lora.install()
    token_map.install()
    block_hashes.install()
    icarus.install()
    _registered = True
