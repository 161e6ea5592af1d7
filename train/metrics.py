"""The training log (``metrics.jsonl``): one JSON record per logged step, appended.

A run killed while appending leaves its last line cut short; that line is dropped, as the
evaluation harness does for its logs (eval/samples_log.py ``read_log``), and logged again after
resuming. A broken line anywhere else means the file was damaged: an error, never skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import KvshareError
from ..fsutil import write_text_atomic


def read_metrics(path: Path) -> list[dict]:
    """The complete records of a metrics log, a torn last line left out."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError
            records.append(record)
        except ValueError:  # JSONDecodeError included
            if number == len(lines):  # after the last newline: written in part
                break
            raise KvshareError(f"{path}: line {number} is not a JSON record; "
                               "move the file away to start over") from None
    return records


def truncate_metrics(path: Path, step: int) -> None:
    """On resume, keep the records up to ``step`` (later ones will be logged again)."""
    path = Path(path)
    if path.is_file():
        kept = [r for r in read_metrics(path) if r["step"] <= step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
