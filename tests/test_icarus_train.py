"""ICaRus training forward: exactness against the base and an independent reference."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from kvshare.testing import ICARUS_TARGETS, TINY_FAMILIES
from kvshare.train.icarus import enable_icarus_attention, icarus_forward
from kvshare.train.icarus_reference import icarus_reference_logits


def icarus_model(folder, randomize_b: bool = True, seed: int = 0):
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(ICARUS_TARGETS),
                                            task_type="CAUSAL_LM"))
    enable_icarus_attention(model)
    if randomize_b:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model


def batch(vocab: int, seed: int = 0, length: int = 12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (2, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding in the second row
    return ids, mask


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_zero_b_decoder_equals_base_exactly(tiny_models, family):
    folder = tiny_models(family)
    model = icarus_model(folder, randomize_b=False)
    ids, mask = batch(model.config.vocab_size)
    with torch.no_grad():
        got = icarus_forward(model, ids, mask).logits
        base = AutoModelForCausalLM.from_pretrained(folder)(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()  # logits at padding positions are arbitrary and never used
    assert torch.equal(got[valid], base[valid])


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_training_forward_equals_the_explicit_reference(tiny_models, family, tied):
    model = icarus_model(tiny_models(family, tied=tied))
    ids, mask = batch(model.config.vocab_size, seed=1)
    with torch.no_grad():
        got = icarus_forward(model, ids, mask).logits
    want = icarus_reference_logits(model, ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    # and it differs from a conventional LoRA forward (the decoder's own K/V): not a no-op
    model.get_base_model().set_attn_implementation("sdpa")
    with torch.no_grad():
        own_kv = model(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(own_kv[valid], want[valid], atol=1e-3)


def test_padding_is_masked_out_of_the_encoder_and_decoder_attention(tiny_models):
    """Left padding (a collator or tokenizer that pads on the left): real tokens must not
    attend to pad tokens, in the base's encoder pass or the decoder's. The registered
    attention needs its mask function registered too; without it transformers built no mask
    and SDPA ran causal only, so padding was attended (harmless only for right padding)."""
    model = icarus_model(tiny_models("llama"))
    ids, mask = batch(model.config.vocab_size, seed=2)
    mask[1] = 1
    mask[1, :3] = 0  # left padding in the second row
    with torch.no_grad():
        got = icarus_forward(model, ids, mask).logits
        unmasked = icarus_forward(model, ids).logits
    want = icarus_reference_logits(model, ids, mask)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unmasked[1, 3:], want[1, 3:], atol=1e-3)  # the pads do change the outputs


def test_gradients_reach_only_lora_weights(tiny_models):
    model = icarus_model(tiny_models("llama"))
    ids, mask = batch(model.config.vocab_size)
    out = icarus_forward(model, ids, mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all("lora_" in n for n in with_grad)
    lora = {n for n, p in model.named_parameters() if "lora_" in n}
    assert with_grad == lora  # every LoRA factor learns, through the decoder path only
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_logits_at_i_ignore_tokens_after_i(tiny_models):
    model = icarus_model(tiny_models("qwen3"))
    ids, _ = batch(model.config.vocab_size, length=10)
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 7) % model.config.vocab_size
    with torch.no_grad():
        a = icarus_forward(model, ids).logits
        b = icarus_forward(model, changed).logits
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_a_few_steps_lower_the_loss_on_a_toy_task(tiny_models):
    """Learn to continue a fixed pattern: the loss must fall clearly within 30 steps."""
    torch.manual_seed(0)
    model = icarus_model(tiny_models("llama"), randomize_b=False)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 2] * 4)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(30):
        loss = icarus_forward(model, ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_the_encoder_pass_projects_no_logits_it_does_not_use(tiny_models):
    """The decoder's logits are the only full ones: the encoder pass reads the base's K/V."""
    model = icarus_model(tiny_models("llama"))
    ids, mask = batch(model.config.vocab_size)
    rows = []
    model.get_base_model().lm_head.register_forward_hook(lambda module, args, out: rows.append(out.shape[1]))
    with torch.no_grad():
        icarus_forward(model, ids, mask)
    assert sum(rows) == ids.shape[1] + 1
