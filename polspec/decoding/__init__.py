"""The decoders, as a library: target-only (autoregressive) and cross-tokenizer speculative.

    from polspec.decoding import DecodingParams, generate
    result = generate(target, draft, messages_or_text, DecodingParams(k=2))

The CLI and the worker are thin layers over :func:`generate` and the streaming generators
in :mod:`polspec.decoding.autoregressive` and :mod:`polspec.decoding.speculative`. Many
sequences decode together with :class:`BatchDecoder` (:mod:`polspec.decoding.batch`).
"""

from polspec.decoding.params import DecodingParams

__all__ = ["BatchDecoder", "DecodingParams", "GenerationResult", "generate", "stream", "stream_batch"]


def __getattr__(name: str):
    # Loaded on first use: the decoders import MLX, which the CLI must not pay for (or fail
    # on) just to parse its options.
    if name in ("GenerationResult", "generate", "stream"):
        from polspec.decoding import run

        return getattr(run, name)
    if name in ("BatchDecoder", "stream_batch"):
        from polspec.decoding import batch

        return getattr(batch, name)
    raise AttributeError(f"module 'polspec.decoding' has no attribute {name!r}")
