"""Command line of the trainer, shared by ``python -m kvshare.train`` and ``kvshare train``."""

from __future__ import annotations

import argparse
import json

from ..errors import KvshareError, exit_code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE.yaml", help="training recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="override recipe fields, e.g. train.lr=1e-4 train.max_steps=20")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in output_dir from its newest intact checkpoint; "
                        "refused if the recipe changed since")
    parser.add_argument("--force-resume", action="store_true",
                        help="like --resume, but go on even if the recipe changed (e.g. a longer "
                        "train.max_steps); the changed keys are printed as a warning")
    parser.add_argument("--stop-after", type=int, metavar="STEPS",
                        help="stop (resumably) at this optimizer step")


def run(args: argparse.Namespace) -> int:
    from .recipe import load_recipe
    from .trainer import train

    if args.stop_after is not None and args.stop_after < 1:  # 0 would write a summary of no training
        raise KvshareError(f"--stop-after must be at least 1, not {args.stop_after}")
    recipe = load_recipe(args.recipe, args.overrides)
    summary = train(recipe, recipe_path=args.recipe, resume=args.resume,
                    force_resume=args.force_resume, stop_after=args.stop_after)
    if summary.get("adapter"):
        print(json.dumps({k: summary[k] for k in ("name", "kind", "steps", "final_loss",
                                                   "seconds_per_step", "adapter")}, indent=1))
    return 0


def _cmd_plot_loss(args: argparse.Namespace) -> int:
    from .plot import plot_loss_curves

    out = plot_loss_curves(args.runs, args.out, labels=args.label)
    print(f"wrote {out}")
    return 0


def register(sub) -> None:
    """Add ``kvshare train`` and ``kvshare plot-loss``."""
    p = sub.add_parser("train", help="train an adapter from a recipe (in-process)",
                       description="Train an ICaRus, aLoRA or LoRA adapter from a YAML recipe; the "
                       "same code as `accelerate launch -m kvshare.train RECIPE.yaml`.")
    add_arguments(p)
    p.set_defaults(func=run)
    p = sub.add_parser("plot-loss", help="overlay the loss curves of training runs",
                       description="Plot loss against step for one or more run folders "
                       "(their metrics.jsonl) on one chart, e.g. ICaRus vs LoRA on one task.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="training output folders")
    p.add_argument("--out", required=True, metavar="PNG", help="image to write")
    p.add_argument("--label", action="append", help="legend label per run (default: run name)")
    p.set_defaults(func=_cmd_plot_loss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshare.train",
                                     description="Train an ICaRus, aLoRA or LoRA adapter from a recipe.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return exit_code(lambda: run(args))
