"""Built-in Polish prompt sets, shipped in ``polspec/data/<name>.jsonl``.

- ``pl-wiki``: encyclopedic openings to continue (structured, factual text);
- ``pl-instruct``: open-ended instructions in the style of pl_alpaca;
- ``pl-short``: short questions with short answers;
- ``pl-struct``: structured Polish text to go on with: lists, tables, JSON, CSV, forms,
  timelines, grammar tables (where a draft guesses most tokens, so speculation pays most).

Each line is ``{"id": ..., "prompt": ...}``, the same format ``polspec enqueue generate --input``
reads, so a dataset is validated by the same code as a user's file. Sweeps also take a path to
such a file, and ``hf:OWNER/NAME[:SPLIT]`` for a Hugging Face dataset (needs the optional
``datasets`` package and access to the hub; the prompt is its ``prompt``, ``instruction``,
``question`` or ``text`` column).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path

from polspec.decoding.params import DecodingParams
from polspec.errors import PolspecError
from polspec.files import user_path
from polspec.jobs.spec import ItemInput, parse_items, parse_jsonl

DATASETS = {
    "pl-wiki": "encyclopedic openings to continue",
    "pl-instruct": "open-ended instructions (pl_alpaca style)",
    "pl-short": "short questions with short answers",
    "pl-struct": "structured text to continue: lists, tables, JSON, CSV, forms",
}


HF_COLUMNS = ("prompt", "instruction", "question", "text")
HF_DEFAULT_SPLIT = "train"


def load_dataset(name: str, base: DecodingParams, limit: int | None = None, *,
                 relative_to: Path | None = None) -> list[ItemInput]:
    """The first ``limit`` items (all without a limit) of a built-in set, a JSONL file or ``hf:``
    set; a relative path to a JSONL file is taken from ``relative_to`` where given (a sweep
    file's folder: the sweep then reads the same file from wherever it is started)."""
    if limit is not None and limit < 1:
        raise PolspecError(f"the item limit must be at least 1, got {limit}")
    if name.startswith("hf:"):
        return _hugging_face(name[3:], base, limit)
    if name.endswith(".jsonl"):
        path = dataset_file(name, relative_to)
        try:
            data = path.read_bytes()
        except OSError as error:
            raise PolspecError(f"{path}: {error.strerror}") from None
        return parse_jsonl(data.splitlines(), str(path), base)[:limit]
    if name not in DATASETS:
        known = ", ".join(f"{key} ({about})" for key, about in DATASETS.items())
        raise PolspecError(f"unknown dataset {name!r}; built-in: {known}; or a .jsonl file, or hf:OWNER/NAME")
    data = resources.files("polspec.data").joinpath(f"{name}.jsonl").read_bytes()
    return parse_jsonl(data.splitlines(), f"dataset {name}", base)[:limit]


def dataset_file(name: str, relative_to: Path | None = None) -> Path:
    """The file a ``.jsonl`` dataset name reads: ``~`` expanded, a relative path taken from
    ``relative_to`` where given."""
    path = user_path(name)
    return relative_to / path if relative_to is not None and not path.is_absolute() else path


def dataset_source(name: str, relative_to: Path | None = None) -> str | Path:
    """What a dataset name reads, one value however it is spelled: a JSONL file's resolved path,
    an ``hf:`` set with its split, else the name (so two names with one source run once)."""
    if name.startswith("hf:"):
        return "hf:{}:{}".format(*_hf_repo_and_split(name[3:]))
    if name.endswith(".jsonl"):
        return dataset_file(name, relative_to).resolve()
    return name


def _hf_repo_and_split(name: str) -> tuple[str, str]:
    """``OWNER/NAME[:SPLIT]`` (after ``hf:``) as the repository and the split, ``train`` by default."""
    repo, _, split = name.partition(":")
    return repo, split or HF_DEFAULT_SPLIT


def _hugging_face(name: str, base: DecodingParams, limit: int | None) -> list[ItemInput]:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo, split = _hf_repo_and_split(name)
    try:  # a malformed name is the user's to fix whatever is installed
        validate_repo_id(repo)
    except HFValidationError:
        raise PolspecError(f"hf:{name}: not a dataset repository name, such as hf:OWNER/NAME[:SPLIT]") from None
    try:
        import datasets
    except ImportError:
        raise PolspecError(f"hf:{name} needs the datasets package: pip install 'polspec[hf]'") from None
    try:
        rows = datasets.load_dataset(repo, split=split, streaming=True)
    except Exception as error:  # the hub client raises many kinds (offline, not found, gated)
        raise PolspecError(f"hf:{name}: cannot load it: {error}") from None
    return parse_items(_hugging_face_rows(name, rows, limit), f"hf:{name}", base)


def _hugging_face_rows(name: str, rows: Iterable[dict], limit: int | None) -> Iterator[tuple[str, str, dict]]:
    """("hf:NAME row N", "row N", a prompt object) for the first ``limit`` rows, from the first text
    column of :data:`HF_COLUMNS` the row has; the row number is the id where there is none."""
    streamed = iter(rows)
    for index in itertools.count():
        if limit is not None and index >= limit:
            return
        try:
            row = next(streamed)
        except StopIteration:
            return
        except Exception as error:  # a streamed set reads as it goes: the hub can fail at any row
            reason = " ".join(str(error).split()) or type(error).__name__
            raise PolspecError(f"hf:{name} row {index}: reading it failed: {reason}") from None
        column = next((key for key in HF_COLUMNS if isinstance(row.get(key), str)), None)
        if column is None:
            raise PolspecError(f"hf:{name}: rows have none of the columns {', '.join(HF_COLUMNS)}")
        yield f"hf:{name} row {index}", f"row {index}", {"id": str(row.get("id", index)), "prompt": row[column]}
