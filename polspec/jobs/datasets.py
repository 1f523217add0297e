"""Built-in Polish prompt sets, shipped in ``polspec/data/<name>.jsonl``.

- ``pl-wiki``: encyclopedic openings to continue (structured, factual text);
- ``pl-instruct``: open-ended instructions in the style of pl_alpaca;
- ``pl-short``: short questions with short answers.

Each line is ``{"id": ..., "prompt": ...}``, the same format ``polspec enqueue generate --input``
reads, so a dataset is validated by the same code as a user's file.
"""

from __future__ import annotations

from importlib import resources

from polspec.decoding.params import DecodingParams
from polspec.errors import PolspecError
from polspec.jobs.spec import ItemInput, parse_jsonl

DATASETS = {
    "pl-wiki": "encyclopedic openings to continue",
    "pl-instruct": "open-ended instructions (pl_alpaca style)",
    "pl-short": "short questions with short answers",
}


def load_dataset(name: str, base: DecodingParams, limit: int | None = None) -> list[ItemInput]:
    """The first ``limit`` items (all without a limit) of a built-in dataset."""
    if name not in DATASETS:
        known = ", ".join(f"{key} ({about})" for key, about in DATASETS.items())
        raise PolspecError(f"unknown dataset {name!r}; built-in: {known}")
    if limit is not None and limit < 1:
        raise PolspecError(f"the item limit must be at least 1, got {limit}")
    data = resources.files("polspec.data").joinpath(f"{name}.jsonl").read_bytes()
    return parse_jsonl(data.splitlines(), f"dataset {name}", base)[:limit]
