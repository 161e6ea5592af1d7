"""Reading PEFT LoRA checkpoints and checking them against a base and a kind's rules.

Shared by ``kvshare export`` (before writing), ``kvshare inspect`` and the serving engine
(before loading): an adapter is only ever used on the exact base it fits, and only under the
sharing rule its kind allows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import KvshareError
from .safetensors_io import TensorSpec, model_weight_files, read_json, refuse_pickles, tensor_specs
from .kinds import AdapterKind, kind_spec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FLOAT_DTYPES = {"F32", "F16", "BF16"}
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")

# PEFT features that change the computation beyond y = xW + s * (x A) B; the engine's
# gathered LoRA implements exactly that, so anything else is refused rather than mis-served.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
_UNSUPPORTED = {
    "use_dora": (True,),
    "lora_bias": (True,),
    "use_qalora": (True,),
}
# LoRA variants PEFT configures by a sub-config (its ``is_lora_variant`` fields): set, each
# adds factors or a forward of its own
_VARIANT_CONFIGS = ("use_bdlora", "kasa_config", "velora_config", "monteclora_config", "arrow_config")
# LoraConfig's defaults: PEFT loads a config written without ``r`` or ``lora_alpha`` with these
PEFT_DEFAULT_RANK, PEFT_DEFAULT_ALPHA = 8, 8


def lora_rank(config: dict) -> int:
    return int(PEFT_DEFAULT_RANK if config.get("r") is None else config["r"])


def lora_alpha(config: dict) -> float:
    return float(PEFT_DEFAULT_ALPHA if config.get("lora_alpha") is None else config["lora_alpha"])


@dataclass(frozen=True)
class PeftCheckpoint:
    folder: Path
    config: dict
    weights: Path
    specs: dict[str, TensorSpec]

    @property
    def invocation_tokens(self) -> list[int] | None:
        return self.config.get("alora_invocation_tokens") or None


@dataclass(frozen=True)
class LoraModule:
    name: str  # e.g. model.layers.0.self_attn.q_proj
    rank: int
    in_features: int
    out_features: int
    dtype: str

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[-1]


def read_peft_checkpoint(folder: Path) -> PeftCheckpoint:
    """Read a PEFT LoRA folder (config + safetensors) without loading the weights."""
    folder = Path(folder)
    if not folder.exists():
        raise KvshareError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise KvshareError(f"{folder}: not a folder (expected a PEFT adapter folder)")
    config = read_json(folder / ADAPTER_CONFIG)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        refuse_pickles(folder, what="adapter weights")
        raise KvshareError(f"{folder}: no {ADAPTER_WEIGHTS}")
    if config.get("peft_type") != "LORA":
        raise KvshareError(
            f"{folder / ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r} is not LORA"
        )
    for key, bad_values in _UNSUPPORTED.items():
        if config.get(key) in bad_values:
            raise KvshareError(f"{folder}: {key}={config[key]} is not supported by kvshare")
    _check_types(folder / ADAPTER_CONFIG, config)
    for key in _VARIANT_CONFIGS:
        if config.get(key):
            raise KvshareError(f"{folder}: {key} is set; that LoRA variant is not supported by kvshare")
    if config.get("bias", "none") != "none":
        raise KvshareError(f"{folder}: bias={config['bias']!r} is not supported (use 'none')")
    for key in ("modules_to_save", "trainable_token_indices", "target_parameters"):
        if config.get(key):
            raise KvshareError(
                f"{folder}: {key} is set; kvshare adapters are LoRA A/B weights on linear "
                "projections only"
            )
    for key in ("alpha_pattern", "rank_pattern"):  # serving fuses q/k/v and gate/up under one scale
        if config.get(key):
            raise KvshareError(f"{folder}: {key} is not supported (one rank and lora_alpha for every module)")
    if config.get("layer_replication"):
        raise KvshareError(f"{folder}: layer_replication is not supported (the base's layers are served as they are)")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        # trained against W - B0 A0 (PEFT re-runs most of these on load and rewrites the base); kvshare serves W
        raise KvshareError(f"{folder}: init_lora_weights={init!r} changes the base weights (W - B0 A0); "
                           "convert it to a plain LoRA first (PEFT's path_initial_model_for_weight_conversion)")
    return PeftCheckpoint(folder, config, weights, tensor_specs(weights))


def _check_types(path: Path, config: dict) -> None:
    """The keys kvshare reads, of the types PEFT writes (a hand-edited config is a clear error,
    not a traceback deep in the export)."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def strings(v):
        return isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, str) for t in v))

    def token_ids(v):
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    rules = {"r": (lambda v: number(v) and v == int(v) and v >= 1, "a whole number >= 1"),
             "lora_alpha": (number, "a number"), "lora_dropout": (number, "a number"),
             "use_rslora": (lambda v: isinstance(v, bool), "true or false"),
             "target_modules": (strings, "a module name, a list of them or a regular expression"),
             "alora_invocation_tokens": (token_ids, "a list of token ids")}
    for key, (valid, what) in rules.items():
        if config.get(key) is not None and not valid(config[key]):
            raise KvshareError(f"{path}: {key} must be {what}, not {config[key]!r}")


def lora_modules(ckpt: PeftCheckpoint) -> list[LoraModule]:
    """Pair up lora_A / lora_B tensors per module and check their shapes agree."""
    parts: dict[str, dict[str, TensorSpec]] = {}
    for key, spec in ckpt.specs.items():
        match = _LORA_KEY.match(key)
        if not match:
            raise KvshareError(
                f"{ckpt.weights}: unexpected tensor {key!r} (only LoRA A/B weights are supported)"
            )
        if spec.dtype not in FLOAT_DTYPES:
            raise KvshareError(f"{ckpt.weights}: tensor {key!r} has dtype {spec.dtype}")
        if len(spec.shape) != 2:
            raise KvshareError(f"{ckpt.weights}: tensor {key!r} is not a matrix {spec.shape}")
        parts.setdefault(match["module"], {})[match["part"]] = spec
    if not parts:
        raise KvshareError(f"{ckpt.weights}: holds no LoRA weights")
    modules = []
    for name, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise KvshareError(f"{ckpt.weights}: module {name} lacks lora_{'A' if 'B' in ab else 'B'}")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != b.shape[1]:
            raise KvshareError(f"{ckpt.weights}: {name}: lora_A {a.shape} and lora_B {b.shape} disagree")
        if a.shape[0] != lora_rank(ckpt.config):
            raise KvshareError(
                f"{ckpt.weights}: {name} has rank {a.shape[0]}, adapter_config.json says r={lora_rank(ckpt.config)}"
            )
        modules.append(LoraModule(name, a.shape[0], a.shape[1], b.shape[0], a.dtype))
    return modules


def check_against_base(ckpt: PeftCheckpoint, modules: list[LoraModule], base_dir: Path) -> None:
    """Every adapted module must exist in the base with matching in/out features."""
    base: dict[str, TensorSpec] = {}
    for file in model_weight_files(base_dir):
        base.update(tensor_specs(file))
    for module in modules:
        weight = base.get(f"{module.name}.weight")
        if weight is None:
            raise KvshareError(
                f"{ckpt.folder}: adapts {module.name}, which the base {base_dir} does not have"
            )
        if weight.shape != (module.out_features, module.in_features):
            raise KvshareError(
                f"{ckpt.folder}: {module.name} expects a {module.out_features}x{module.in_features} "
                f"projection, the base has {weight.shape[0]}x{weight.shape[1]} - "
                "was it trained on another base?"
            )
    targets = ckpt.config.get("target_modules")
    if isinstance(targets, list):
        names = [k[: -len(".weight")] for k in base if k.endswith(".weight")]
        for target in targets:
            if not any(n == target or n.endswith("." + target) for n in names):
                raise KvshareError(
                    f"{ckpt.folder}: target module {target!r} does not exist in base {base_dir}"
                )


def target_leaves(ckpt: PeftCheckpoint, modules: list[LoraModule]) -> list[str]:
    """Module leaf names the adapter touches (q_proj, o_proj, ...), sorted.

    Sorted because PEFT stores target_modules as a set: its order varies between runs.
    """
    seen: dict[str, None] = {}
    targets = ckpt.config.get("target_modules")
    if isinstance(targets, list):
        for target in targets:
            seen.setdefault(target.rsplit(".", 1)[-1], None)
    for module in modules:
        seen.setdefault(module.leaf, None)
    return sorted(seen)


def check_kind_rules(
    kind: AdapterKind,
    ckpt: PeftCheckpoint,
    leaves: list[str],
    invocation_string: str | None,
    tokenizer=None,
) -> list[int] | None:
    """Enforce what ``kind`` requires of the checkpoint; return aLoRA invocation ids."""
    tokens = ckpt.invocation_tokens
    if not kind_spec(kind).needs_invocation:
        if tokens:
            raise KvshareError(
                f"{ckpt.folder}: adapter_config.json sets alora_invocation_tokens, so PEFT runs it "
                f"as an aLoRA; export it with --kind alora, not {kind.value}"
            )
        forbidden = sorted(m for m in leaves if m in kind_spec(kind).forbidden_targets)
        if forbidden:
            raise KvshareError(
                f"{ckpt.folder}: an {kind.value} adapter may not target {', '.join(forbidden)}: "
                "its keys and values must stay the frozen base's so every agent can share the "
                "KV cache (and a decoder-only LoRA never writes KV, so those weights are dead)"
            )
        return None
    if ckpt.config.get("task_type") != "CAUSAL_LM":
        raise KvshareError(
            f"{ckpt.folder}: an aLoRA needs task_type 'CAUSAL_LM' in adapter_config.json "
            f"(found {ckpt.config.get('task_type')!r}); PEFT computes the activation offsets only "
            "in PeftModelForCausalLM and would otherwise silently run the bare base"
        )
    if not tokens or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise KvshareError(
            f"{ckpt.folder}: an aLoRA needs alora_invocation_tokens (a list of token ids) in "
            "adapter_config.json"
        )
    if not invocation_string:
        raise KvshareError(
            "an aLoRA export needs its invocation string (--invocation TEXT), checked against "
            "the token ids in adapter_config.json"
        )
    if tokenizer is not None:
        encoded = tokenizer.encode(invocation_string, add_special_tokens=False)
        if list(encoded) != list(tokens):
            raise KvshareError(
                f"invocation string {invocation_string!r} encodes to {list(encoded)} with the base's "
                f"tokenizer, but adapter_config.json has alora_invocation_tokens={tokens}"
            )
    return list(tokens)
