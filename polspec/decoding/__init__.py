"""The decoders, as a library: target-only (autoregressive) and cross-tokenizer speculative.

    from polspec.decoding import DecodingParams, generate
    result = generate(target, draft, messages_or_text, DecodingParams(k=2))

The CLI and the worker are thin layers over :func:`generate` and the streaming generators
in :mod:`polspec.decoding.autoregressive` and :mod:`polspec.decoding.speculative`.
"""

from polspec.decoding.params import DecodingParams
from polspec.decoding.run import GenerationResult, generate, stream

__all__ = ["DecodingParams", "GenerationResult", "generate", "stream"]
