"""kvshare's vLLM plugin: aLoRA adapters in vLLM, their pre-invocation KV shared with the base.

vLLM loads it through the ``vllm.general_plugins`` entry point in each of its processes (the
API server, the engine core, every worker) when kvshare is installed beside it. It changes
nothing for requests without an aLoRA adapter, and three things for those with one:

- the worker accepts a PEFT folder with ``alora_invocation_tokens`` (vLLM refuses it);
- each token before the invocation's start (PEFT's rule: the last occurrence in the prompt)
  runs on base weights, the rest on the adapter's (:mod:`.alora`);
- in the engine core, prefix-cache blocks wholly before the invocation are hashed as the base
  hashes them, so an aLoRA request reuses the base's blocks and the base reuses its; blocks
  that reach the invocation keep vLLM's per-adapter key (:mod:`.block_hashes`).

It also fixes vLLM's CPU LoRA kernels, which give a token with no adapter (slot -1) the
adapter in the last slot (:mod:`.cpu_lora`): without that, a base token beside a LoRA request
in one batch is computed wrongly, and so is every pre-invocation aLoRA token.

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
    from . import alora, block_hashes, cpu_lora

    cpu_lora.install()
    alora.install()
    block_hashes.install()
    _registered = True
