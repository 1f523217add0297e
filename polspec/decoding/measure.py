"""Measuring a :class:`~polspec.decoding.costmodel.Probe` on two loaded models: timed target
and draft forwards, a timed translation and the batch table, on the machine at hand."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from polspec import backend  # before mlx: the Linux BLAS fix

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from polspec.cpu_share import measuring, share_cores
from polspec.decoding import batch_kv
from polspec.decoding.costmodel import BATCH_POSITIONS, BATCH_SIZES, RHO_SIZES, BatchCost, Probe
from polspec.decoding.draft_head import DraftHead, vocabulary_size
from polspec.decoding.draft_vocab import draft_head
from polspec.decoding.kv import new_cache, prefill, trim
from polspec.decoding.params import DecodingParams
from polspec.decoding.policy import DraftLength
from polspec.decoding.probe_files import machine_key
from polspec.decoding.speculative import DraftSide
from polspec.decoding.translate import same_tokenizer, token_bytes, translate_draft_to_target
from polspec.errors import PolspecError
from polspec.models.loader import LoadedModel

# Polish text for the translation timing and the draft's proposal rounds.
_TEXT = ("Kraków jest jednym z najstarszych miast w Polsce. Przez wieki był stolicą kraju, a jego "
         "Stare Miasto wpisano na listę światowego dziedzictwa UNESCO.")


def measure_probe(target: LoadedModel, draft: LoadedModel, repeats: int = 9, context: int = 64,
                  batch_sizes: tuple[int, ...] = BATCH_SIZES, draft_vocab: int | str = "auto",
                  stage: Callable[[str], None] = lambda _: None) -> Probe:
    """Measure c, d, rho(1..9), tau, the draft's feed and the batch table for two loaded models
    on this machine.

    The draft runs the way it decodes: logits at the last position only, over the vocabulary
    ``draft_vocab`` gives it (see :mod:`polspec.decoding.draft_vocab`).

    Forward times are medians over ``repeats`` with ``context`` tokens already cached, the
    way decoding runs, every size timed in turn within a repeat; the draft's feed is the
    median time of ``context`` tokens of text taken in one forward, as a first proposal
    takes a prompt, per token; tau is the median time of an
    ``aligned`` translation of a k=4 draft chunk of Polish text, over the target step. The
    batch table times target forwards over B sequences x m positions (m in
    ``BATCH_POSITIONS``) and a draft step over B sequences for every B in ``batch_sizes``
    that memory holds (a third of ``repeats``, at least 3: the large shapes dominate the
    probe's time).
    ``stage`` is told what is measured next, for a progress display. PolspecError when
    ``repeats`` is below 1.
    """
    if repeats < 1:
        raise PolspecError(f"repeats must be at least 1, got {repeats}")
    same_tokenizer(target, draft)  # a wrong tokenizer family is refused before minutes of measuring
    with measuring():
        return _measured_probe(target, draft, repeats, context, batch_sizes, draft_vocab, stage)


def _measured_probe(target: LoadedModel, draft: LoadedModel, repeats: int, context: int,
                    batch_sizes: tuple[int, ...], draft_vocab: int | str, stage: Callable[[str], None]) -> Probe:
    head = draft_head(draft, draft_vocab)
    stage(f"target forwards over 1-{RHO_SIZES} tokens")
    target_times = _forward_times(target, target.model, range(1, RHO_SIZES + 1), repeats, context)
    step = target_times[0]
    stage("draft step")
    draft_step = _forward_times(draft, head, [1], repeats, context)[0]
    feed = new_cache(draft.model, draft.entry.alias)
    draft_feed = median_times([head], [mx.array([list(range(1, context + 1))])], [feed],
                              [lambda cache: trim(cache, context)], repeats)[0] / context

    target_table, draft_table = token_bytes(target.tokenizer._tokenizer), token_bytes(draft.tokenizer._tokenizer)
    target_ids = target.tokenizer.encode(_TEXT)
    draft_ids = draft.tokenizer.encode(_TEXT)
    times = []
    for start in range(4, len(draft_ids) - 4, 3):
        clock = time.perf_counter()
        translate_draft_to_target("aligned", draft_table, target_table, draft_ids[start:start + 4],
                                  target_ids[: max(1, start)], 5, 10)
        times.append(time.perf_counter() - clock)
    batch_repeats = max(3, repeats // 3)
    batch = []
    for size in _sizes_that_fit(target, draft, head, batch_sizes, context):
        stage(f"both models at batch size {size}")
        batch.append(BatchCost(size, tuple(_batch_forward_times(target, target.model, size, BATCH_POSITIONS,
                                                                batch_repeats, context)),
                               _batch_forward_times(draft, head, size, [1], batch_repeats, context)[0]))
    stage("a draft round")
    chosen = backend.setup()
    return Probe(target.entry.alias, draft.entry.alias, c=draft_step / step, batch=tuple(batch),
                 rho=tuple(t / step for t in target_times), tau=statistics.median(times) / step,
                 draft_overhead=max(0.0, _draft_round_time(draft, head, draft_ids, repeats) - draft_step) / step,
                 target_step_s=step, draft_step_s=draft_step, draft_vocab=head.size, draft_feed_s=draft_feed,
                 largest_batch_tried=max(batch_sizes, default=0),
                 machine={"key": machine_key(), "platform": chosen.platform, "device": chosen.device,
                          "dtype": chosen.dtype, "mlx": chosen.mlx_version})


def _draft_round_time(draft: LoadedModel, head: DraftHead, text_ids: list[int], repeats: int) -> float:
    """Median time of a real one-token proposal round of the decoder's draft side.

    Each round first re-syncs the draft with two more tokens of committed text, as after a
    round that accepted one candidate and added the target's own token, then proposes one
    token; the difference from a bare draft step is the per-round overhead ``d``.
    """
    prompt, rest = text_ids[:8], text_ids[8:]
    side = DraftSide(draft, prompt, None, head)
    policy = DraftLength(DecodingParams(k=1))
    side.propose(1, policy)  # feeds the prompt: not a round
    times = []
    for round_ in range(min(repeats, (len(rest) - 1) // 2)):
        side.resync(rest[: 2 * round_ + 2], b"")
        clock = time.perf_counter()
        side.propose(1, policy)
        times.append(time.perf_counter() - clock)
    return statistics.median(times)


def _forward_times(loaded: LoadedModel, forward, sizes, repeats: int, context: int) -> list[float]:
    """Median time of ``forward`` (the model, or a draft head) over m tokens for each m in ``sizes``,
    ``context`` tokens cached.

    The sizes are timed in turn within each repeat, so that a change in the machine's load
    during the probe shifts every size alike and the ratios rho(m) stay sound.
    """
    sizes = list(sizes)
    caches = []
    for m in sizes:
        cache = new_cache(loaded.model, loaded.entry.alias)
        prefill(loaded.model, cache, list(range(1, context + 1)))
        caches.append(cache)
    inputs = [mx.array([list(range(2, m + 2))]) for m in sizes]
    return median_times([forward] * len(sizes), inputs, caches, [lambda cache, m=m: trim(cache, m) for m in sizes],
                        repeats)


def _sizes_that_fit(target: LoadedModel, draft: LoadedModel, head: DraftHead, sizes: tuple[int, ...],
                    context: int) -> list[int]:
    """The batch sizes whose probe caches fit in memory (the smallest always: a table needs a row).

    At each size the target holds a cache per count of positions and the draft one, each
    grown by a step of entries past ``context``, and the widest forward's logits: some 6 GB at
    B = 64 for a 1.5B target in float32, several times that for an 11B one."""
    entries = context + max(BATCH_POSITIONS) + BatchKVCache.step
    per_row = entries * (len(BATCH_POSITIONS) * batch_kv.kv_bytes_per_token(target.model, target.entry.alias)
                         + batch_kv.kv_bytes_per_token(draft.model, draft.entry.alias)) \
        + 4 * max(BATCH_POSITIONS) * (vocabulary_size(target.model) + (head.size or vocabulary_size(draft.model)))
    budget = batch_kv.free_memory_bytes() * batch_kv.MEMORY_SHARE
    return [size for index, size in enumerate(sorted(sizes)) if not index or size * per_row <= budget]


def plain_step_s(loaded: LoadedModel, size: int, context: int = 64) -> float:
    """The time of one plain batched step of ``loaded`` over ``size`` sequences of ``context``
    cached tokens (one warm-up forward, then one timed)."""
    return _batch_forward_times(loaded, loaded.model, size, [1], 1, context)[0]


def _batch_forward_times(loaded: LoadedModel, forward, size: int, positions, repeats: int, context: int) -> list[float]:
    """Median time of ``forward`` over ``size`` sequences x m positions for each m in ``positions``,
    through the batched decoder's ragged cache, ``context`` tokens cached per sequence."""
    layers = batch_kv.check_batchable(loaded.model, loaded.entry.alias)
    positions = list(positions)
    # One prefill serves every row (join copies it into each): a forward's time does not depend
    # on what the rows hold, and at B = 64 prefilling each row would take minutes on a 1.5B model.
    single = batch_kv.prefill_one(loaded.model, layers, list(range(1, context + 1)))
    caches = [batch_kv.join(None, [single] * size) for _ in positions]
    inputs = [mx.array([list(range(2, m + 2))] * size) for m in positions]
    undo = [lambda cache, m=m: batch_kv.trim_each(cache, [m] * size) for m in positions]
    return median_times([forward] * len(positions), inputs, caches, undo, repeats)


def median_times(forwards: list, inputs: list, caches: list, undo: list, repeats: int) -> list[float]:
    """Median time of each forward over its input with its cache, all in turn within a repeat;
    ``undo[i](cache)`` takes the forward's entries out of the cache again, untimed. Each repeat
    starts with this process's share of the cores (:func:`~polspec.cpu_share.share_cores`): a
    probe beside another process decoding would otherwise time both fighting over every core."""
    times: list[list[float]] = [[] for _ in inputs]
    for round_ in range(repeats + 1):  # the first round warms each shape up and is not kept
        share_cores()
        for index, (forward, tokens, cache) in enumerate(zip(forwards, inputs, caches)):
            clock = time.perf_counter()
            mx.eval(forward(tokens, cache))
            if round_:
                times[index].append(time.perf_counter() - clock)
            undo[index](cache)
    return [statistics.median(values) for values in times]
