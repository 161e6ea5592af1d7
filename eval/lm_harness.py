"""The kvshare engine as an lm-eval model: ``lm_eval --model kvshare`` (through ``kvshare lm-eval``).

lm-eval has models for HF, vLLM and others, none of which run our adapters with their sharing
semantics (ICaRus decoders over base KV, aLoRA from the invocation on), so this adapter sends
every request through :class:`kvshare.serve.LLMEngine`: ``generate_until`` generates,
``loglikelihood`` and ``loglikelihood_rolling`` score with the engine's ``prompt_logprobs``.
Importing this module registers the model under the name ``kvshare``.

``model_args``: ``pretrained`` (or ``base``; a zoo name or a folder), ``adapter`` (an exported
adapter folder), ``dtype``, ``kv_cache_tokens``, ``max_gen_toks``. An aLoRA adapter is active
only after its invocation: with ``--apply_chat_template`` the chat is laid out as it was
trained (conversation, then invocation); plain-text prompts without it get the base model's
behaviour, which is what aLoRA means.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from ..errors import KvshareError
from ..serve import SamplingParams
from .harness import load_llm

TASKS_DIR = Path(__file__).with_name("tasks")
# settings lm-eval tasks pass that change nothing here (greedy search is all the engine does)
_NEUTRAL_GEN_KWARGS = {"num_beams", "use_cache", "skip_special_tokens", "spaces_between_special_tokens"}


@register_model("kvshare")
class KvshareLM(TemplateLM):
    def __init__(self, pretrained: str | None = None, base: str | None = None, adapter: str | None = None,
                 dtype: str = "float32", kv_cache_tokens: int = 32768, max_gen_toks: int = 256,
                 batch_size: int | str = 16, **_ignored):
        super().__init__()
        model = pretrained or base
        if model is None:
            raise ValueError("model_args needs pretrained=NAME_OR_DIR (or base=...)")
        self.llm, self.adapter = load_llm(model, adapter, dtype=dtype, kv_cache_tokens=int(kv_cache_tokens))
        self.engine = self.llm.engine
        self.tokenizer = self.engine.tokenizer
        self.max_gen_toks = int(max_gen_toks)
        self.batch_size = 16 if batch_size == "auto" else int(batch_size)
        self._name = f"{model}+{adapter}" if adapter else str(model)

    # tokenizer ------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What conditions an empty context: BOS if the tokenizer has one, as lm-eval's HF model."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer_name(self) -> str:
        return self._name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """As lm-eval's HF model encodes: None = the tokenizer's default (a Llama tokenizer adds
        BOS), but no second BOS where the text starts with one (a chat template's)."""
        from lm_eval.models.utils import has_bos_prefix

        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **special)
        return encoding[-left_truncate_len:] if left_truncate_len else encoding

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        if add_generation_prompt:  # the layout the adapter was trained with (aLoRA: invocation)
            ids = self.engine.chat_prompt(chat_history, self.adapter)
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=False,
                                                  continue_final_message=True)

    # requests -------------------------------------------------------------------------------
    def _run(self, prompts: list[list[int]], params: list[SamplingParams], desc: str, disable_tqdm: bool):
        """Generate in batches of ``batch_size``; outputs in order."""
        outputs = []
        with tqdm(total=len(prompts), desc=desc, disable=disable_tqdm) as bar:
            for start in range(0, len(prompts), self.batch_size):
                end = start + self.batch_size
                outputs += self.llm.generate(prompts[start:end], params[start:end], adapter=self.adapter)
                bar.update(len(prompts[start:end]))
        return outputs

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        prompts, spans = [], []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length - 1):]  # room for one sampled token
            prompts.append(whole)
            spans.append(len(continuation))
        outs = self._run(prompts, [SamplingParams(max_tokens=1, prompt_logprobs=1)] * len(prompts),
                         "loglikelihood", disable_tqdm)
        results = []
        for out, n in zip(outs, spans):
            scored = out.prompt_logprobs[-n:] if n else []  # an empty continuation: log 1, greedy
            logprob = sum(entry["logprob"] for entry in scored)
            greedy = all(max(entry["top"], key=entry["top"].get) == entry["token"] for entry in scored)
            results.append((logprob, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, target in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 2, context_len=1)):
                windows.append((None, context, target))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for context, gen_kwargs in (req.args for req in requests):
            # lm-eval's own rules, as its HF and vLLM models: max_gen_toks and its aliases
            # (max_new_tokens, max_tokens, ...), a temperature > 0 samples unless do_sample is false
            kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs), default_max_gen_toks=self.max_gen_toks))
            until, max_tokens = [u for u in kwargs.pop("until") if u], int(kwargs.pop("max_gen_toks"))
            temperature = float(kwargs.pop("temperature", 0.0))
            temperature = temperature if kwargs.pop("do_sample") else 0.0
            if max_tokens >= self.max_length:
                raise KvshareError(f"max_gen_toks {max_tokens} leaves no room for the prompt in the model's "
                                   f"{self.max_length} tokens")
            params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                         top_p=float(kwargs.pop("top_p", 1.0) or 1.0),
                                         top_k=max(0, int(kwargs.pop("top_k", 0) or 0)),
                                         min_p=float(kwargs.pop("min_p", 0.0) or 0.0),
                                         repetition_penalty=float(kwargs.pop("repetition_penalty", 1.0) or 1.0),
                                         seed=kwargs.pop("seed", None), stop=until))
            ignored = sorted(set(kwargs) - _NEUTRAL_GEN_KWARGS)
            if ignored:
                warnings.warn(f"kvshare ignores these generation settings: {', '.join(ignored)}", stacklevel=2)
            prompts.append(self.tok_encode(context)[-(self.max_length - max_tokens):])
        outs = self._run(prompts, params, "generate_until", disable_tqdm)
        return [out.text for out in outs]
