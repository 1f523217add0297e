"""Target-only decoding: the baseline every speculative configuration is measured against."""

from __future__ import annotations

import time
from collections.abc import Iterator

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from polspec.decoding.commit import Commit
from polspec.decoding.kv import prefill
from polspec.decoding.metrics import DecodeMetrics
from polspec.decoding.params import DecodingParams
from polspec.decoding.sampling import sequence_seed, token_sampler
from polspec.models.loader import LoadedModel


def generate_autoregressive(
    target: LoadedModel, prompt: list[int], params: DecodingParams, metrics: DecodeMetrics, *,
    without_its_draft: bool = False,
) -> Iterator[Commit]:
    """Yield the target's tokens one at a time until EOS or ``params.max_tokens``.
    ``without_its_draft``: a speculative request decoded target-only (a prompt too long for
    its draft, a machine where no k pays), whose steps count as plain rounds.

    The last prompt token is fed with the first decode step, exactly as the speculative
    decoder does, and ``decode_s`` sums the steps alone, as the speculative decoder sums its
    phases, not the caller's work between tokens (a worker's progress writes, a terminal's
    printing): prefill and decode times compare one to one.
    """
    seed = sequence_seed(params)
    sample = token_sampler(params, seed)
    metrics.seed = seed if params.temperature > 0 else None
    eos = set(target.tokenizer.eos_token_ids)
    cache = make_prompt_cache(target.model)
    metrics.prompt_tokens = len(prompt)
    start = time.perf_counter()
    prefill(target.model, cache, prompt[:-1])
    metrics.prefill_s = time.perf_counter() - start
    token = prompt[-1]
    try:
        while metrics.generated_tokens < params.max_tokens:
            start = time.perf_counter()
            logits = target.model(mx.array([[token]]), cache=cache)[0, -1]
            token = sample(logits).item()
            metrics.rounds += 1
            metrics.plain_rounds += without_its_draft
            metrics.decode_s += time.perf_counter() - start
            if token in eos:
                metrics.finish_reason = "stop"
                break
            metrics.generated_tokens += 1
            yield Commit([token])
        else:
            metrics.finish_reason = "length"
    finally:  # also where the caller stops early (a stop string): no finish reason then
        metrics.peak_memory_gb = mx.get_peak_memory() / 1e9
