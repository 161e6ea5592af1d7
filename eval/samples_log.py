"""The evaluation log format (``samples.jsonl``, ``evalplus.jsonl``): a header record, then
one record per sample, keyed by its ``id``. Apart from the harness, which loads the engine,
so that readers such as ``kvshare eval compare`` start fast."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from ..errors import KvshareError
from ..fsutil import write_text_atomic

HEADER_KEY = "kvshare_eval_log"  # the header record's marker (its value: the header's format)
HEADER_FORMAT = 1


def _whole_lines(text: str) -> str:
    """``text`` without a last line cut short (the run was killed while writing it); a last
    line written whole but for its newline gets the newline."""
    tail = text.rpartition("\n")[2]  # what follows the last newline: "" unless the run was killed
    if not tail.strip():
        return text
    try:
        json.loads(tail)
    except json.JSONDecodeError:
        return text[: len(text) - len(tail)]
    return text + "\n"


def read_log(path: Path, repair: bool = True) -> tuple[dict | None, dict[str, dict]]:
    """The header and finished samples of a log. A last line cut short is left out (and, with
    ``repair``, dropped from the file, so the sample is generated again and appended cleanly);
    a broken line anywhere else means the log was damaged, and that is an error, not something
    to skip."""
    if not path.is_file():
        return None, {}
    if path.suffix == ".gz":  # a committed log, compressed: read only
        text, repair = gzip.decompress(path.read_bytes()).decode("utf-8"), False
    else:
        text = path.read_text(encoding="utf-8")
    whole = _whole_lines(text)
    if repair and whole != text:
        write_text_atomic(path, whole)
    header, records = None, {}
    # split on newlines only: outputs may hold U+2028 or U+0085, which JSON leaves unescaped
    for number, line in enumerate(whole.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise KvshareError(f"{path}: line {number} is not a JSON record; move the file away to start over") from None
        if not isinstance(record, dict) or (HEADER_KEY not in record and "id" not in record):
            raise KvshareError(f"{path}: line {number} is not a sample record (no 'id')")
        if HEADER_KEY in record:
            if number != 1:
                raise KvshareError(f"{path}: line {number} is a second header (logs were joined?); "
                                   "move the file away to start over")
            header = record
        else:
            records[record["id"]] = record
    return header, records
