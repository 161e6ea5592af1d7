"""Loss curves of several runs on one chart (e.g. ICaRus vs LoRA vs aLoRA on one task)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import KvshareError
from . import metrics


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise KvshareError(f"{run_dir}: no metrics.jsonl (is it a training output folder?)")
    return metrics.read_metrics(path)


def plot_loss_curves(runs: list[str | Path], out: str | Path, labels: list[str] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if labels and len(labels) != len(runs):
        raise KvshareError(f"{len(labels)} labels for {len(runs)} runs")
    out = Path(out)
    image_format = out.suffix.lower().lstrip(".")
    formats = plt.gcf().canvas.get_supported_filetypes()
    plt.close()
    if image_format not in formats:
        raise KvshareError(f"--out {out}: unknown image format {out.suffix or '(no extension)'!r} "
                           f"(use one of {', '.join('.' + f for f in sorted(formats))})")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, run in enumerate(runs):
        rows = [r for r in read_metrics(Path(run)) if "loss" in r]  # eval records have none
        label = labels[i] if labels else Path(run).name
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (response tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:  # a reader sees the old image or the new one, never half of one
        fig.savefig(tmp, dpi=120, format=image_format)
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out
