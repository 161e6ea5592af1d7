"""Tiny random Llama-family models saved as real Hugging Face folders, for tests.

Every component is tested through its real loading path (config.json, safetensors,
tokenizer.json, chat template), so the factory writes complete folders. The tokenizer is a
real byte-level BPE trained in milliseconds on a built-in text, with ChatML special tokens
like SmolLM2's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .families import FAMILIES

TINY_FAMILIES = tuple(FAMILIES)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|invoke|>", "<|end_invoke|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A team of agents shares one base model and
one key-value cache. Question: what is 12 plus 30? Answer: 42. The answer is 7.
def add(a, b):
    return a + b
for i in range(10):
    print(i * 2)
Paris is the capital of France. Rome is the capital of Italy. Who wrote the report?
Evaluate the answer above: is it correct? Yes. No. #### 18
0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } : ; , . ! ? ' "
"""


def make_tokenizer(vocab_size: int = 400):
    """A real byte-level BPE tokenizer (transformers' fast tokenizer) with ChatML tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator([_CORPUS] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_config(family: str = "llama", *, vocab_size: int, num_layers: int = 2,
                tied: bool = True, **overrides):
    """Config of a tiny grouped-query-attention model (4 query heads over 2 KV heads)."""
    from transformers import AutoConfig

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose from {TINY_FAMILIES}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.1,  # peakier logits than 0.02, so greedy ties are unlikely
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    if family == "mistral":
        common["sliding_window"] = None
    if family in ("qwen2", "qwen3"):
        common["use_sliding_window"] = False
    return AutoConfig.for_model(family, **common)


def make_tiny_model(
    out_dir: Path | str,
    family: str = "llama",
    *,
    num_layers: int = 2,
    tied: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> Path:
    """Write a random tiny model of ``family`` with a real tokenizer to ``out_dir``.

    ``overrides`` change config fields (e.g. ``hidden_size=96``).
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    tokenizer = make_tokenizer()
    config = tiny_config(family, vocab_size=len(tokenizer), num_layers=num_layers, tied=tied,
                         **overrides)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def random_model_like(model_dir: Path | str, out_dir: Path | str, *, seed: int = 0) -> Path:
    """A folder with ``model_dir``'s config, tokenizer and chat template but random weights.

    For timing where the weights cannot travel (a lent GPU machine reaches no registry and takes
    64 MiB of files; SmolLM2-135M's weights are 538 MB): speed depends on the shapes, not the
    values. Only config, tokenizer and generation files are read from ``model_dir``.
    """
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    src, out = Path(model_dir), Path(out_dir)
    config = AutoConfig.from_pretrained(str(src))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return out


# random non-zero adapters live in random_adapters.py (benchmarks use them too)
from .random_adapters import ICARUS_TARGETS, make_peft_adapter  # noqa: E402,F401
