"""The training loop shared by the three adapter kinds.

Written on accelerate (device placement, DDP, bf16 autocast) rather than transformers'
Trainer because ICaRus needs a two-pass forward (frozen encoder, then adapted decoder) and
resumption must be exact and pickle-free; the loop stays small enough to read in one go.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import random
import re
import sys
import time
import warnings
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import KvshareError
from ..fsutil import write_text_atomic
from ..hardware import resolve_mixed_precision, warn_if_bf16_is_slow
from ..models import check_servable, resolve_model_dir
from ..kinds import kind_spec
from . import checkpoint as ckpt
from .collate import IGNORE, collate, invocation_ids, tokenize_all
from .data import Example, load_file, load_hub, load_named
from .evaluation import build_eval_task, evaluate_adapter
from .icarus import enable_icarus_attention, icarus_forward
from .metrics import read_metrics, truncate_metrics
from .recipe import Recipe, flatten, recipe_drift
from .rng import save_rng
from .teardown import leave_process_group


def load_examples(recipe: Recipe) -> list[Example]:
    examples: list[Example] = []
    for source in recipe.data.sources:
        if source.name:
            examples += load_named(source.name, source.limit)
        elif source.path:
            examples += load_file(source.path, source.prompt_field, source.response_field, source.limit)
        else:
            examples += load_hub(source.hub, source.split, source.prompt_field,
                                 source.response_field, source.config, source.limit)
    if not examples:
        raise KvshareError("the recipe's data sources hold no training examples")
    return examples


def build_model(recipe: Recipe, base_dir: Path):
    """Base + LoRA of the recipe's kind; returns (peft_model, tokenizer, invocation ids)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    if not tokenizer.chat_template:
        raise KvshareError(f"{base_dir}: the tokenizer has no chat template, and training formats every "
                           "example as a chat; use an instruct base or add chat_template to its tokenizer_config.json")
    if tokenizer.pad_token_id is None:  # Llama/Mistral tokenizers: padding is masked out, any id does
        tokenizer.pad_token = tokenizer.eos_token
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32,
                                                use_safetensors=True, local_files_only=True)
    spec = recipe.adapter
    modules = dict(base.named_modules())
    for target in spec.target_modules:  # what PEFT will adapt: every module named so, or ending so
        matched = [n for n in modules if n == target or n.endswith("." + target)]
        if not matched:
            raise KvshareError(f"adapter.target_modules: {target!r} not in {base_dir} "
                               f"(its projections: {', '.join(sorted(_linear_leaves(base)))})")
        _check_servable_target(target, matched, modules, spec.kind)
    invocation = invocation_ids(tokenizer, spec.invocation) if kind_spec(spec.kind).needs_invocation else None
    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        # CAUSAL_LM for every kind: aLoRA offsets are only computed in PeftModelForCausalLM.
        task_type="CAUSAL_LM",
        alora_invocation_tokens=invocation,
    )
    model = get_peft_model(base, config)
    if kind_spec(spec.kind).base_kv_only:
        enable_icarus_attention(model)
    return model, tokenizer, invocation


def _holds_a_run(run_dir: Path) -> bool:
    """Whether a fresh run would overwrite an earlier one's results: a checkpoint, the summary
    or the adapter. A run that died before its first checkpoint (metrics, a checkpoint's staging
    folder) left nothing to resume, so a fresh run may start over it."""
    return bool(ckpt.checkpoints(run_dir) or (run_dir / "summary.json").exists()
                or (run_dir / "adapter").exists())


_SERVED_PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+$")


def _check_servable_target(target: str, matched: list[str], modules: dict, kind) -> None:
    """Refuse before training what export or serving would refuse after it: the engine serves
    LoRA on the decoder layers' linear projections only (not the head, the embedding or a whole
    block), and a kind's forbidden projections (ICaRus's k/v) stay forbidden however they are
    named (``self_attn.k_proj`` is ``k_proj``)."""
    for name in matched:
        if not isinstance(modules[name], torch.nn.Linear) or not _SERVED_PROJECTION.match(name):
            served = {n.rsplit(".", 1)[-1] for n, m in modules.items()
                      if isinstance(m, torch.nn.Linear) and _SERVED_PROJECTION.match(n)}
            raise KvshareError(f"adapter.target_modules: {target!r} names {name}, which the engine does not serve "
                               f"LoRA on (only the decoder layers' linear projections: {', '.join(sorted(served))})")
        leaf = name.rsplit(".", 1)[-1]
        if leaf in kind_spec(kind).forbidden_targets:
            raise KvshareError(f"adapter.target_modules: {target!r} adapts {leaf}, which an {kind.value} adapter "
                               "may not target (its keys and values always come from the frozen base)")


def _linear_leaves(model: torch.nn.Module) -> set[str]:
    """Leaf names of the model's linear layers (q_proj, up_proj, ...), for an error message."""
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def _enable_checkpointing(base) -> None:
    """Activation checkpointing on every decoder layer, non-reentrant (works with frozen
    inputs, no ``enable_input_require_grads``, and with keyword arguments such as ICaRus's)."""
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers' name since 5.x
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def make_scheduler(optimizer, recipe: Recipe, total_steps: int):
    from transformers import (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                              get_linear_schedule_with_warmup)

    warmup = int(round(recipe.train.warmup_ratio * total_steps))
    make = {"cosine": get_cosine_schedule_with_warmup, "linear": get_linear_schedule_with_warmup}
    if recipe.train.schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    return make[recipe.train.schedule](optimizer, warmup, total_steps)


def _rates_from_recipe(optimizer, scheduler, tp) -> None:
    """The learning rate and weight decay the recipe gives, after a resume restored the saved
    optimizer and schedule (they differ when --force-resume changed train.lr or weight_decay)."""
    for group in optimizer.param_groups:
        group["initial_lr"], group["weight_decay"] = tp.lr, tp.weight_decay
    scheduler.base_lrs = [tp.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = tp.lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def micro_batches(n_items: int, batch: int, world: int, rank: int, seed: int, epoch: int):
    """This rank's micro-batches of one epoch: a seeded permutation, dealt round-robin."""
    order = torch.randperm(n_items, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    per_step = batch * world
    for start in range(0, n_items - per_step + 1, per_step):
        yield order[start + rank * batch: start + (rank + 1) * batch]


def lora_digest(model) -> str:
    digest = hashlib.sha256()
    for name, value in sorted(ckpt.lora_state(model).items()):
        digest.update(name.encode())
        digest.update(value.float().cpu().numpy().tobytes())
    return digest.hexdigest()


def resume_point(recipe: Recipe, run_dir: Path, *, force: bool = False, warn: bool = True) -> Path:
    """The checkpoint to resume from: the newest intact one, trained with this recipe.

    Broken newer checkpoints are skipped with a warning; a recipe that differs from the
    checkpoint's in keys that change training is refused unless ``force``.
    """
    folder, skipped = ckpt.pick_checkpoint(run_dir)
    for bad, reason in skipped if warn else ():
        warnings.warn(f"skipping checkpoint {bad} ({reason}); resuming from {folder.name}", stacklevel=2)
    try:
        drift = recipe_drift(ckpt.saved_recipe(folder), recipe)
    except (OSError, ValueError) as err:
        raise KvshareError(f"{folder}: unreadable recipe.json ({err})") from None
    if drift and not force:
        raise KvshareError(f"--resume: the recipe differs from the one {folder} was trained with "
                           f"in {', '.join(drift)}; restore it, or pass --force-resume to go on anyway")
    if drift and warn:
        warnings.warn(f"--force-resume: resuming {folder} with a changed recipe ({', '.join(drift)})",
                      stacklevel=2)
    return folder


# sharded training: checkpoints, the weights digest and the export run on the main process over
# its own parameters, which under these are a shard of the adapter (a crash, a hang or a partial
# checkpoint at the first save); LoRA weights are small, so DDP (every rank a full copy) fits
_UNSUPPORTED_DISTRIBUTION = {
    "FSDP": "the trainer saves and exports on the main process, which holds only its shard of the adapter; "
            "use DDP (recipes/accelerate/gpu-ddp.yaml): LoRA weights are small, so a full copy per GPU fits",
    "DEEPSPEED": "the trainer saves and exports on the main process (ZeRO shards the adapter); use DDP "
                 "(recipes/accelerate/gpu-ddp.yaml)",
}


def _last_logged_loss(metrics_path: Path) -> float:
    """The loss of the last training record in ``metrics.jsonl`` (NaN if none)."""
    losses = [r["loss"] for r in read_metrics(metrics_path) if "loss" in r] if metrics_path.is_file() else []
    return float(losses[-1]) if losses else float("nan")


def _last_logged_eval(metrics_path: Path) -> dict | None:
    """The last evaluation record in ``metrics.jsonl`` (a resumed run's summary keeps it)."""
    evals = [r for r in read_metrics(metrics_path) if "eval" in r] if metrics_path.is_file() else []
    return evals[-1] if evals else None


def train(recipe: Recipe, *, recipe_path: str | None = None, resume: bool = False,
          force_resume: bool = False, stop_after: int | None = None) -> dict:
    """Run a recipe to the end (or to ``stop_after`` steps); return the run summary.

    The summary is also written to ``output_dir/summary.json``; the adapter is exported with
    its manifest to ``output_dir/adapter``. ``force_resume`` resumes even if the recipe changed.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    # accelerate keeps its settings in a process-wide singleton; a second run in the same
    # process (kvshare story, a notebook) may use another mixed precision. The process group
    # (PartialState) is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    # cpu=True on CPU-only machines lets torchrun-launched processes form a gloo DDP group.
    # the device that trains: a GPU unless there is none or the launcher asks for the CPU (use_cpu)
    on_gpu = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes")
    precision = resolve_mixed_precision(recipe.train.mixed_precision, on_gpu)
    if recipe.train.mixed_precision == "bf16":
        warn_if_bf16_is_slow("train.mixed_precision bf16")
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launcher not in ("no", precision):  # accelerate launch --mixed_precision, or a config file's
        warnings.warn(f"the launcher's mixed_precision {launcher!r} is not used: the recipe's train.mixed_precision "
                      f"decides ({recipe.train.mixed_precision!r}, here {precision!r})", RuntimeWarning, stacklevel=2)
    run_dir = Path(recipe.output_dir)
    for tracker in recipe.train.report_to:
        if importlib.util.find_spec(tracker) is None:
            raise KvshareError(f"train.report_to: {tracker} is not installed (pip install 'kvshare[tracking]')")
    # the other processes wait at a barrier while the main one evaluates (eval_every): the
    # process group's timeout is the recipe's (HF's ddp_timeout: 30 min), not NCCL's 10
    group = InitProcessGroupKwargs(timeout=timedelta(seconds=recipe.train.ddp_timeout))
    accel = Accelerator(mixed_precision=precision, cpu=not on_gpu,
                        log_with=list(recipe.train.report_to) or None, project_dir=str(run_dir / "logs"),
                        kwargs_handlers=[group])
    if accel.distributed_type.value in _UNSUPPORTED_DISTRIBUTION:
        raise KvshareError(f"accelerate's {accel.distributed_type.value} is not supported by kvshare train: "
                           f"{_UNSUPPORTED_DISTRIBUTION[accel.distributed_type.value]}")
    main = accel.is_main_process
    resume = resume or force_resume
    resume_from = resume_point(recipe, run_dir, force=force_resume, warn=main) if resume else None
    if not resume and _holds_a_run(run_dir):
        raise KvshareError(f"{run_dir} already holds a run; pass --resume to continue it "
                           "or choose another output_dir")
    set_seed(recipe.train.seed)
    base_dir = resolve_model_dir(recipe.base_model)
    check_servable(base_dir)  # before hours of training an adapter the engine would refuse
    model, tokenizer, invocation = build_model(recipe, base_dir)
    if recipe.train.gradient_checkpointing:
        _enable_checkpointing(model.get_base_model())
    examples = load_examples(recipe)
    items, stats = tokenize_all(examples, tokenizer, recipe.data.max_length,
                                invocation=invocation, system_prompt=recipe.data.system_prompt)
    if not items:
        raise KvshareError(f"every example is longer than max_length={recipe.data.max_length}")
    world, rank = accel.num_processes, accel.process_index
    tp = recipe.train
    steps_per_epoch = len(items) // (tp.batch_size * world * tp.grad_accum)
    if steps_per_epoch == 0:
        raise KvshareError("fewer examples than one optimizer step needs (batch_size x grad_accum x processes)")
    total = tp.max_steps or max(1, math.ceil(tp.epochs * steps_per_epoch))

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=tp.lr, weight_decay=tp.weight_decay)
    scheduler = make_scheduler(optimizer, recipe, total)
    peft_model = model
    model, optimizer = accel.prepare(model, optimizer)

    state = {"step": 0, "epoch": 0, "micro": 0, "tokens": 0, "seconds": 0.0}
    if resume_from is not None:
        state = ckpt.load_checkpoint(resume_from, model=peft_model, optimizer=optimizer,
                                     scheduler=scheduler, rank=rank, processes=world)
        _rates_from_recipe(optimizer, scheduler, tp)
    metrics_path = run_dir / "metrics.jsonl"
    resolved = recipe.model_dump(mode="json")
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(metrics_path, state["step"])
        write_text_atomic(run_dir / "recipe.resolved.json", json.dumps(resolved, indent=1))
    if recipe.train.report_to:
        accel.init_trackers(recipe.name, config=tracker_config(resolved))

    def log(record: dict) -> None:
        """Append to metrics.jsonl (the source of truth), then hand to the trackers."""
        if main:
            with open(metrics_path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        if recipe.train.report_to:
            accel.log(tracker_values(record), step=record["step"])

    def forward(batch, num_items: torch.Tensor):
        """The loss summed over the batch's response tokens / ``num_items`` (transformers'
        ``num_items_in_batch``, as HF's Trainer), so every token of an optimizer step weighs
        the same whatever micro-batch or process it is in."""
        if kind_spec(recipe.adapter.kind).base_kv_only:
            return icarus_forward(model, batch["input_ids"], batch["attention_mask"],
                                  batch["labels"], peft_model=peft_model, num_items_in_batch=num_items)
        if "alora_offsets" in batch:  # PEFT takes a list
            batch = {**batch, "alora_offsets": batch["alora_offsets"].tolist()}
        return model(**batch, num_items_in_batch=num_items)

    if main and tp.eval_task:  # reads its data now: a missing file stops the run before it trains, not after
        build_eval_task(tp.eval_task, tp.eval_limit, tp.eval_max_tokens)
    bar = tqdm(total=total, initial=state["step"], desc=recipe.name, disable=not main,
               file=sys.stderr, dynamic_ncols=True)
    # the open logging window (its step losses, tokens and seconds so far) is part of the
    # checkpoint: a run resumed in mid-window logs the same records as one never stopped
    window: list[float] = list(state.get("window", []))
    last_eval = _last_logged_eval(metrics_path) if main and resume_from is not None else None
    # mean loss of the last logged window: the run's final loss (a run resumed at its last step,
    # killed while exporting, logs no window: its final loss is the one logged before)
    last_loss = _last_logged_loss(metrics_path) if main and resume_from is not None else float("nan")
    started = time.perf_counter() - state["seconds"]
    window_start = time.perf_counter() - state.get("window_seconds", 0.0)
    window_tokens = state.get("window_tokens", 0)
    model.train()
    limit = total if stop_after is None else min(total, stop_after)
    batches, batches_epoch = [], None
    while state["step"] < limit:
        if batches_epoch != state["epoch"]:
            order_seed = tp.seed if recipe.data.shuffle_seed is None else recipe.data.shuffle_seed
            batches = list(micro_batches(len(items), tp.batch_size, world, rank, order_seed, state["epoch"]))
            batches_epoch = state["epoch"]
        if state["micro"] + tp.grad_accum > len(batches):
            state["epoch"], state["micro"] = state["epoch"] + 1, 0
            continue
        step_loss = 0.0
        micro = [{k: v.to(accel.device) for k, v in
                  collate([items[j] for j in batches[state["micro"] + i]], tokenizer.pad_token_id).items()}
                 for i in range(tp.grad_accum)]
        # the step's response tokens on every process (labels shift by one inside the loss)
        num_items = accel.reduce(sum((b["labels"][:, 1:] != IGNORE).sum() for b in micro), reduction="sum")
        for i, batch in enumerate(micro):
            sync = i == tp.grad_accum - 1
            context = accel.no_sync(model) if not sync else _null()
            with context, accel.autocast():
                # DDP averages gradients over processes: times world, the step's token mean
                loss = forward(batch, num_items).loss * world
                accel.backward(loss)
            step_loss += loss.detach()
            window_tokens += int(batch["attention_mask"].sum()) * world
        if tp.max_grad_norm:
            accel.clip_grad_norm_(params, tp.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state["micro"] += tp.grad_accum
        state["step"] += 1
        step_value = accel.reduce(step_loss.detach().clone(), reduction="mean").item()
        window.append(step_value)
        if not math.isfinite(step_value):
            raise KvshareError(f"loss became {step_value} at step {state['step']}; "
                               "lower train.lr or use mixed_precision: no")
        if state["step"] % tp.log_every == 0 or state["step"] == total:
            now = time.perf_counter()
            record = {"step": state["step"], "loss": sum(window) / len(window),
                      "lr": scheduler.get_last_lr()[0], "epoch": state["epoch"],
                      "tokens_per_s": window_tokens / max(now - window_start, 1e-9),
                      "seconds": now - started}
            last_loss = record["loss"]
            log(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                            tok_s=f"{record['tokens_per_s']:.0f}")
            window, window_start, window_tokens = [], now, 0
        bar.update(1)
        # saved before the evaluation: an evaluation that fails must not take the steps since the last save
        if state["step"] % tp.save_every == 0 or state["step"] == limit:
            state["seconds"] = time.perf_counter() - started
            state.update(window=window, window_tokens=window_tokens,
                         window_seconds=time.perf_counter() - window_start)
            _save(run_dir, accel, peft_model, optimizer, scheduler, state, rank, resolved)
        if tp.eval_every and state["step"] % tp.eval_every == 0:
            if main:
                last_eval = {"step": state["step"], "eval": _evaluate_now(recipe, peft_model, run_dir, base_dir,
                                                                          state["step"], str(accel.device))}
                log(last_eval)
            accel.wait_for_everyone()
    bar.close()
    if window:  # stopped (--stop-after) in mid-window: its loss so far, not logged until the window closes
        last_loss = sum(window) / len(window)

    digests = accel.gather_for_metrics([lora_digest(peft_model)], use_gather_object=True)
    summary = {
        "recipe": recipe_path, "name": recipe.name, "kind": recipe.adapter.kind.value,
        "steps": state["step"], "total_steps": total, "final_loss": last_loss,
        "train_seconds": time.perf_counter() - started,
        "seconds_per_step": (time.perf_counter() - started) / max(state["step"], 1),
        "processes": world, "mixed_precision": precision, "rank_weight_digests": digests,
        "ranks_in_sync": len(set(digests)) == 1,
        "examples": len(examples), "data": asdict(stats) | {"dropped_ids": stats.dropped_ids[:20]},
        "finished": state["step"] >= total,
        "last_eval": last_eval,
    }
    if main:
        if not summary["ranks_in_sync"]:
            raise KvshareError(f"DDP ranks ended with different adapter weights: {digests}")
        if summary["finished"]:
            summary["adapter"] = str(_export(recipe, recipe_path, peft_model, run_dir, base_dir, summary))
        write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=1))
    accel.wait_for_everyone()
    accel.end_training()
    # together, before the return frees the model (see teardown.py for the deadlock this avoids)
    leave_process_group(model)
    return summary


def _save(run_dir: Path, accel, peft_model, optimizer, scheduler, state: dict, rank: int,
          recipe: dict) -> None:
    rng_dir = run_dir / ".rng"
    rng_dir.mkdir(parents=True, exist_ok=True)
    save_rng(rng_dir / f"rank-{rank}.safetensors")
    accel.wait_for_everyone()
    if accel.is_main_process:
        files = {r: rng_dir / f"rank-{r}.safetensors" for r in range(accel.num_processes)}
        ckpt.save_checkpoint(run_dir / "checkpoints" / f"step-{state['step']}", model=peft_model,
                             optimizer=optimizer, scheduler=scheduler, trainer_state=dict(state),
                             rng_files=files, recipe=recipe)
    accel.wait_for_everyone()


def _export(recipe: Recipe, recipe_path, peft_model, run_dir: Path, base_dir: Path, summary) -> Path:
    provenance = {"recipe": recipe_path, "data": [s.label for s in recipe.data.sources],
                  "steps": summary["steps"], "seed": recipe.train.seed,
                  "final_loss": summary["final_loss"], "train_seconds": round(summary["train_seconds"], 1)}
    return _export_to(recipe, peft_model, run_dir / "final", run_dir / "adapter", provenance)


def _export_to(recipe: Recipe, peft_model, peft_dir: Path, out: Path, provenance: dict) -> Path:
    from ..export import export_adapter

    peft_model.save_pretrained(str(peft_dir))
    return export_adapter(peft_dir, kind=recipe.adapter.kind, base=recipe.base_model, out=out, name=recipe.name,
                          invocation=recipe.adapter.invocation, provenance=provenance, force=True,
                          system_prompt=recipe.data.system_prompt)


def _evaluate_now(recipe: Recipe, peft_model, run_dir: Path, base_dir: Path, step: int, device: str) -> dict:
    """Export the adapter as it stands and score it through the engine (train/evaluation.py)."""
    folder = run_dir / "eval" / f"step-{step}"
    adapter = _export_to(recipe, peft_model, folder / "peft", folder / "adapter", {"steps": step})
    tp = recipe.train
    python_rng = random.getstate()
    with torch.random.fork_rng():  # the training run draws the same numbers with or without evaluations
        scores = evaluate_adapter(adapter, str(base_dir), tp.eval_task, tp.eval_limit, tp.eval_max_tokens, folder,
                                  device)
    random.setstate(python_rng)
    return scores


def tracker_config(resolved: dict) -> dict:
    """The recipe as flat ``key: scalar`` pairs (what tensorboard's hparams and trackio take)."""
    return {key: value if isinstance(value, (bool, int, float, str)) or value is None else json.dumps(value)
            for key, value in flatten(resolved).items()}


def tracker_values(record: dict) -> dict:
    """A metrics record as tracker scalars: ``loss``, ``lr``, ..., and ``eval/<task>/<metric>``."""
    values = {k: v for k, v in record.items() if k not in ("step", "eval") and isinstance(v, (int, float))}
    if "eval" in record:
        task = record["eval"]["task"]
        values.update({f"eval/{task}/{k}": v for k, v in record["eval"].items()
                       if k not in ("task",) and isinstance(v, (int, float))})
    return values


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
