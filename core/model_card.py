"""The model card (``README.md``) ``kvshare export`` writes beside an adapter's files.

Other tools (the Hub, PEFT, vLLM, llama.cpp converters) read an adapter folder without
knowing kvshare's manifest, so the card says in plain words what the adapter is and how it
must be loaded: an ICaRus adapter loaded as a plain LoRA computes its own keys and values and
so behaves unlike how it was trained; an aLoRA loaded as a plain LoRA applies to every token.
The card is documentation only: nothing kvshare verifies or hashes reads it.
"""

from __future__ import annotations

from . import zoo
from .kinds import kind_spec

CARD_FILE = "README.md"


def _how_to_load(data: dict) -> str:
    spec = kind_spec(data["kind"])
    if spec.base_kv_only:
        return (
            "> **Warning: do not load this adapter as a plain LoRA.** It is an ICaRus adapter: it was "
            "trained to read keys and values computed by the frozen base model, for every token. "
            "Loaded as an ordinary LoRA (PEFT's `PeftModel.from_pretrained`, vLLM's `--lora-modules`, "
            "llama.cpp's `--lora`), its weights also change the hidden states that every later layer's "
            "keys and values are computed from, so the model attends to its *own* keys and values "
            "instead of the base's. It then behaves differently from how it was trained and evaluated "
            "(it has no `k_proj`/`v_proj` weights, but that does not keep its keys and values the "
            "base's). Serve it with `kvshare serve` or `kvshare.serve.LLM`, which pair it with the "
            "base's KV cache (shared with the base and every other ICaRus adapter)."
        )
    if spec.needs_invocation:
        alora = data["alora"]
        return (
            "> **Warning: load this adapter as an activated LoRA (aLoRA), never as a plain LoRA.** It "
            "applies only from the start of the last occurrence of its invocation "
            f"(`{alora['invocation_string']}`, token ids `{alora['invocation_token_ids']}`); the "
            "tokens before it keep the base model's keys and values. PEFT >= 0.18 does this from "
            "`alora_invocation_tokens` in `adapter_config.json` (present in this folder). A loader "
            "that ignores that field (an older PEFT, a plain-LoRA loader) applies the adapter to "
            "every token, which is not how it was trained. End a prompt with the invocation to "
            "activate it; `kvshare serve` appends it to chat requests."
        )
    return ("It is a conventional LoRA: any LoRA loader (PEFT, vLLM, llama.cpp after conversion) "
            "runs it as it was trained. Its keys and values are its own, so in kvshare its KV cache "
            "is private too.")


def render(data: dict) -> str:
    """The card's text for the adapter described by manifest ``data``."""
    from huggingface_hub import ModelCard, ModelCardData

    kind, base = data["kind"], data["base_model"]
    lora = data["lora"]
    hub_base = zoo.ZOO[base["name"]].hub_id if base["name"] in zoo.ZOO else base["name"]
    metadata = ModelCardData(base_model=hub_base, library_name="peft",
                             tags=["kvshare", f"kvshare-{kind}", "lora", "peft"])
    invocation = (f" Invocation: `{data['alora']['invocation_string']}`."
                  if kind_spec(kind).needs_invocation else "")
    body = f"""
# {data['name']}

{"An" if kind[0] in "aeiou" else "A"} **{kind}** adapter for `{hub_base}`, exported by kvshare {data['provenance']['kvshare_version']}:
LoRA rank {lora['rank']} (alpha {lora['alpha']}) on {', '.join(f'`{m}`' for m in lora['target_modules'])}.{invocation}

It was made for the base with fingerprint `{base['fingerprint']}` (family {base['family']},
tokenizer `{base['tokenizer_fingerprint']}`); kvshare refuses to load it over any other base.
`kvshare.json` beside this card is the machine-readable description.

## What its kind means

{kind_spec(kind).description}

## Loading it outside kvshare

{_how_to_load(data)}
"""
    return str(ModelCard(f"---\n{metadata.to_yaml()}\n---\n{body}"))
