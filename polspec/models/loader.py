"""Load an alias as an MLX model and tokenizer, with the backend's dtype policy applied.

``load_model`` makes the alias's files local first (:func:`polspec.models.files.fetch_model`).
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from polspec import backend

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from polspec.models.fetch import ProgressFn, no_progress
from polspec.models.files import context_length, fetch_model
from polspec.models.registry import ModelEntry, Registry, load_registry

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready to run: the mlx-lm module, its tokenizer and where they came from."""

    entry: ModelEntry
    path: Path
    model: nn.Module
    tokenizer: TokenizerWrapper
    dtype: str
    load_seconds: float
    # Its output layer as a draft, per pruned vocabulary size (polspec.decoding.draft_vocab).
    draft_heads: dict = field(default_factory=dict, repr=False, compare=False)

    @cached_property
    def context_length(self) -> int | None:
        """The longest sequence the model was trained for, when its config says (read once: each
        request checks it, and a draft's text is kept within it)."""
        return context_length(self.path)


def _native_quantization_bits(path: Path) -> int | None:
    """Bits of the GGUF quantization an imported directory came from (None: not quantized)."""
    info = path / "polspec-import.json"
    if not info.exists():
        return None
    import gguf

    file_type = json.loads(info.read_text()).get("file_type")
    if file_type is None:
        return None
    match = re.search(r"Q(\d)", gguf.LlamaFileType(file_type).name)
    return int(match.group(1)) if match else None


def apply_dtype_policy(model: nn.Module, path: Path, dtype: str) -> tuple[nn.Module, str]:
    """Cast or quantize ``model`` per the policy; return it and what it now runs in."""
    from mlx_lm.utils import dequantize_model

    quantized = any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    if dtype == "native":
        bits = _native_quantization_bits(path)
        if bits is None or quantized:
            return model, "native"
        # An imported GGUF is stored as exact float32; its native form is its quantization.
        nn.quantize(model, group_size=32 if bits <= 4 else 64, bits=min(max(bits, 2), 8))
        return model, f"q{bits}"
    if quantized:
        model = dequantize_model(model)
    model.set_dtype(getattr(mx, dtype))
    return model, dtype


def load_model(alias: str, registry: Registry | None = None, progress: ProgressFn = no_progress) -> LoadedModel:
    """Fetch (if needed) and load ``alias`` on the backend's device with its dtype policy."""
    from mlx_lm import load

    policy = backend.setup()
    entry = (registry or load_registry()).model(alias)
    path = fetch_model(entry, progress)
    start = time.perf_counter()
    model, tokenizer = load(str(path), lazy=True)
    model, dtype = apply_dtype_policy(model, path, policy.dtype)
    mx.eval(model.parameters())
    vocabulary = tokenizer.get_vocab()
    for token in entry.eos_tokens:
        if token in vocabulary:
            tokenizer.add_eos_token(token)
        else:  # a typo's generations would run to max_tokens unseen: not an error, a registry may serve several files
            log.warning("%s: its end-of-sequence token %r (eos_tokens) is not in its vocabulary: no generation "
                        "stops at it", alias, token)
    return LoadedModel(entry, path, model, tokenizer, dtype, time.perf_counter() - start)
