"""Training data: named loaders for the task families, local first, Hugging Face Hub second.

Each loader yields :class:`Example` (prompt text and response text, plus a stable id).
Files come from ``$KVSHARE_DATA`` (default ``../shared/data``); without them gsm8k, mbpp,
code_alpaca and alpaca read the same data from the Hub by name (math_cot, squad and hotpotqa
are local only). No evaluation record ever reaches training: named loaders
pass their ids through :func:`kvshare.splits.is_eval_record`, evaluation files and Hub splits
(split expressions included) are refused by name, and every record of every source is checked
by id and question text against :func:`kvshare.splits.eval_guard`, which catches copies under
another name: such records are dropped with a warning, a source made only of them is refused.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ..errors import KvshareError
from ..paths import data_dir
from ..splits import (EVAL_FILES, MBPP_SPLITS, SQUAD_TRAIN_TITLES, eval_guard, eval_hub_splits,
                      is_eval_record)

_ID_KEYS = ("id", "_id", "task_id", "qid", "question_id")
_JSON_KINDS = {type(None): "null", bool: "a boolean", dict: "an object", list: "a list"}


@dataclass(frozen=True)
class Example:
    id: str  # "<source>/<record id>"
    prompt: str
    response: str


def _jsonl(path: Path) -> list:
    return [row for _, row in _numbered_jsonl(path)]


def _numbered_jsonl(path: Path) -> list[tuple[int, object]]:
    """Each record with its line number, blank lines counted, so that an error names the line
    an editor shows."""
    rows = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                raise KvshareError(f"{path}: line {number} is not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as err:
                raise KvshareError(f"{path}: line {number}: malformed JSON ({err.msg}, "
                                   f"column {err.colno})") from None
    return rows


def _json(path: Path):
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _instruction_prompt(row: dict) -> str:
    extra = (row.get("input") or "").strip()
    return row["instruction"].strip() + (f"\n\n{extra}" if extra else "")


def _gsm8k(rows: Iterable[dict]) -> Iterable[tuple[str, str, str]]:
    for i, row in enumerate(rows):
        yield str(i), row["question"].strip(), row["answer"].strip()


def _math_cot(rows):
    for i, row in enumerate(rows):
        yield str(i), _instruction_prompt(row), row["output"].strip()


def _instructions(rows):
    for i, row in enumerate(rows):
        yield str(i), _instruction_prompt(row), row["output"].strip()


def mbpp_prompt(row: dict) -> str:
    tests = "\n".join(row["test_list"])
    return f"{row['text'].strip()}\nYour code should pass these tests:\n{tests}"


def _mbpp(rows):
    for row in rows:
        if int(row["task_id"]) in MBPP_SPLITS["train"]:
            code = row["code"].replace("\r\n", "\n").strip()
            yield str(row["task_id"]), mbpp_prompt(row), f"```python\n{code}\n```"


def qa_prompt(question: str, paragraphs: list[tuple[str, str]]) -> str:
    """Question + context paragraphs, the layout the QA adapter is trained and scored on."""
    context = "\n\n".join(f"{title}: {text}" if title else text for title, text in paragraphs)
    return f"{context}\n\nAnswer the question with a short phrase from the text.\nQuestion: {question.strip()}"


def _squad(data):
    articles = data["data"] if isinstance(data, dict) else data
    for article in articles:
        if article["title"] not in SQUAD_TRAIN_TITLES:
            continue
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                yield (f"{article['title']}/{qa['id']}",
                       qa_prompt(qa["question"], [("", paragraph["context"])]),
                       qa["answers"][0]["text"].strip())


def _hotpotqa(rows):
    for row in rows:
        ctx = row["context"]
        paragraphs = [(t, "".join(s)) for t, s in zip(ctx["title"], ctx["sentences"])]
        yield row["id"], qa_prompt(row["question"], paragraphs), row["answer"].strip()


@dataclass(frozen=True)
class Loader:
    local: str  # path under the data folder
    read: Callable[[Path], object]
    parse: Callable
    hub: tuple[str, str | None, str] | None  # (dataset id, config, split)


LOADERS: dict[str, Loader] = {
    "gsm8k": Loader("gsm8k/train.jsonl", _jsonl, _gsm8k, ("openai/gsm8k", "main", "train")),
    "math_cot": Loader("math_cot/math_data.json", _json, _math_cot, None),
    "mbpp": Loader("mbpp/mbpp.jsonl", _jsonl, _mbpp, ("google-research-datasets/mbpp", "full", "train")),
    "code_alpaca": Loader("code_alpaca/code_alpaca_2k.json", _json, _instructions,
                          ("sahil280114/codealpaca", None, "train")),
    "squad": Loader("squad/dev-v1.1-small.json", _json, _squad, None),
    "hotpotqa": Loader("hotpotqa/dev_500_hf.jsonl", _jsonl, _hotpotqa, None),
    "alpaca": Loader("alpaca/alpaca_small.json", _json, _instructions, ("tatsu-lab/alpaca", None, "train")),
}


def load_named(name: str, limit: int | None = None) -> list[Example]:
    """Examples of a named loader, from the local data folder or else the Hub."""
    if name not in LOADERS:
        raise KvshareError(f"unknown data set {name!r} (known: {', '.join(sorted(LOADERS))})")
    loader = LOADERS[name]
    folder = data_dir()
    local = folder / loader.local if folder else None
    if local is not None and local.is_file():
        origin = str(local)
        try:
            rows = loader.read(local)
        except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
            raise KvshareError(f"{local}: not readable as {name} data ({type(err).__name__}: {err})") from None
    elif loader.hub is not None:
        origin = loader.hub[0]
        rows = _hub_rows(*loader.hub)
    else:
        raise KvshareError(f"data set {name!r} needs {loader.local} under KVSHARE_DATA "
                           f"(looked in {folder}); it has no Hub fallback")
    try:  # a damaged or foreign file: records without the fields this loader reads
        parsed = list(loader.parse(rows))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise KvshareError(f"{origin}: its records are not {name}'s ({type(err).__name__}: {err})") from None
    examples = ((Example(f"{name}/{record_id}", prompt, response), (record_id,), ())
                for record_id, prompt, response in parsed
                if not is_eval_record(name, record_id))  # held out for evaluation
    return _guarded(name, examples, limit)


def load_file(path: str | Path, prompt_field: str, response_field: str,
              limit: int | None = None) -> list[Example]:
    """Examples from a local JSON or JSONL file of records with the two given fields."""
    path = Path(path)
    folder = data_dir()
    for eval_file in EVAL_FILES:
        if folder is not None and path.resolve() == (folder / eval_file).resolve():
            raise KvshareError(f"{path} is evaluation data ({eval_file}); it may not be trained on")
    if not path.is_file():
        raise KvshareError(f"{path}: no such data file")
    if path.suffix == ".jsonl":
        rows = [(f"{path}: line {n}", row) for n, row in _numbered_jsonl(path)]
    else:
        try:
            records = _json(path)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise KvshareError(f"{path}: malformed JSON ({err})") from None
        if not isinstance(records, list):
            raise KvshareError(f"{path}: a JSON data file is a list of records")
        rows = _numbered(str(path), records)
    return _field_examples(path.stem, rows, prompt_field, response_field, limit)


def load_hub(dataset: str, split: str, prompt_field: str, response_field: str,
             config: str | None = None, limit: int | None = None) -> list[Example]:
    held_out = eval_hub_splits(dataset, split)
    if held_out:
        raise KvshareError(f"{dataset} split {split!r} reads {' and '.join(held_out)}, which is "
                           "evaluation data; it may not be trained on")
    return _field_examples(dataset, _numbered(dataset, _hub_rows(dataset, config, split)),
                           prompt_field, response_field, limit)


def _numbered(origin: str, rows: Iterable) -> Iterable[tuple[str, object]]:
    """Records labelled ``origin: record i`` for error messages (JSONL files give lines instead)."""
    return ((f"{origin}: record {i}", row) for i, row in enumerate(rows))


def _field_examples(source: str, rows: Iterable[tuple[str, object]], prompt_field: str,
                    response_field: str, limit: int | None) -> list[Example]:
    """``rows`` holds (where, record) pairs; ``where`` names the record in an error."""
    def examples():
        for i, (where, row) in enumerate(rows):
            if not isinstance(row, dict) or prompt_field not in row or response_field not in row:
                raise KvshareError(f"{where} lacks field {prompt_field!r} or {response_field!r}")
            ids = tuple(str(row[k]) for k in _ID_KEYS if isinstance(row.get(k), (str, int)))
            texts = tuple(v for v in row.values() if isinstance(v, str))
            prompt, response = (_text(row, key, where) for key in (prompt_field, response_field))
            yield Example(f"{source}/{i}", prompt, response), ids, texts

    return _guarded(source, examples(), limit)


def _text(row: dict, key: str, where: str) -> str:
    """A record's field as text: a number reads as its digits, but null, a boolean, a list or an
    object is refused rather than trained on as ``None`` or a Python repr."""
    value = row[key]
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    kind = _JSON_KINDS.get(type(value), type(value).__name__)
    raise KvshareError(f"{where}: field {key!r} is {kind}, not text")


def _guarded(source: str, records: Iterable[tuple[Example, tuple, tuple]],
             limit: int | None) -> list[Example]:
    """Examples that match no evaluation record, up to ``limit``; see the module docstring.

    ``records`` holds (example, the record's ids, its other texts) triples.
    """
    guard = eval_guard(str(data_dir()) if data_dir() else None)
    kept: list[Example] = []
    dropped: dict[str, int] = {}
    for example, ids, texts in records:
        hit = guard.match(ids, (example.prompt, *texts))
        if hit:
            dropped[hit] = dropped.get(hit, 0) + 1
        else:
            kept.append(example)
            if limit is not None and len(kept) >= limit:
                break
    if dropped and not kept:
        raise KvshareError(f"{source} is evaluation data ({', '.join(sorted(dropped))}); "
                           "it may not be trained on")
    if dropped:
        warnings.warn(f"{source}: dropped {sum(dropped.values())} records that are evaluation data "
                      f"({', '.join(f'{n} from {s}' for s, n in sorted(dropped.items()))})", stacklevel=3)
    return kept


def _hub_rows(dataset: str, config: str | None, split: str):
    import datasets

    try:
        return datasets.load_dataset(dataset, config, split=split)
    except Exception as err:  # the hub raises many types; all mean "not available here"
        where = f"none in {data_dir()}" if data_dir() else "set KVSHARE_DATA to a folder of local data sets"
        raise KvshareError(
            f"could not load {dataset} ({split}) from the Hugging Face Hub and no local copy was "
            f"found ({where}): {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from None
