"""Models kept resident across jobs: an LRU cache bounded by the bytes of their weights.

Loading an 11B model takes tens of seconds, so the worker loads a target and its draft once
and keeps them while jobs for them keep coming. When a new model does not fit in the budget,
the least recently used ones are dropped first. A model that failed to load is remembered with
its error, so the rest of its items fail at once with the same reason instead of each paying
for another attempt; restart the worker after fixing the cause.
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict
from collections.abc import Callable

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx
from mlx.utils import tree_flatten

from polspec.errors import PolspecError
from polspec.models.fetch import ProgressFn, progress_lines
from polspec.models.loader import LoadedModel, load_model
from polspec.settings import model_cache_bytes

log = logging.getLogger("polspec.worker")
LOG_EVERY_S = 10.0


def model_bytes(model: LoadedModel) -> int:
    return sum(array.nbytes for _, array in tree_flatten(model.model.parameters()))


def logged_steps(alias: str, every_s: float = LOG_EVERY_S) -> ProgressFn:
    """Progress that logs making ``alias``'s files local (see
    :func:`~polspec.models.fetch.progress_lines`): steps of a first fetch, another worker's
    fetch waited for, the import."""
    return progress_lines(lambda line: log.info("%s: %s", alias, line), every_s)


class ModelCache:
    """``get(alias)`` returns a loaded model, loading it (and evicting others) when needed."""

    def __init__(self, budget_bytes: int | None = None, loader: Callable[..., LoadedModel] = load_model):
        self.budget = model_cache_bytes() if budget_bytes is None else budget_bytes
        self.loader = loader
        self.models: OrderedDict[str, tuple[LoadedModel, int]] = OrderedDict()
        self.failures: dict[str, str] = {}

    def get(self, alias: str, keep: tuple[str, ...] = ()) -> LoadedModel:
        """The model for ``alias``; ``keep`` names models that must not be evicted to make room."""
        if alias in self.models:
            self.models.move_to_end(alias)
            return self.models[alias][0]
        if alias in self.failures:
            raise PolspecError(self.failures[alias])
        try:
            model = self.loader(alias, progress=logged_steps(alias))
        except PolspecError as error:
            self.failures[alias] = f"{alias} failed to load: {error}"
            raise PolspecError(self.failures[alias]) from None
        size = model_bytes(model)
        self.models[alias] = (model, size)
        self._evict(keep=(alias, *keep))
        return model

    @property
    def resident_bytes(self) -> int:
        return sum(size for _, size in self.models.values())

    def _evict(self, keep: tuple[str, ...]) -> None:
        for alias in list(self.models):
            if self.resident_bytes <= self.budget:
                break
            if alias not in keep:
                del self.models[alias]
        gc.collect()
        mx.clear_cache()
