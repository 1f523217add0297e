"""The draft's next-token logits, computed only where they are used.

A draft forward feeds one or more positions (the text committed since the last round, then
one token per draft step) but only the last position's logits propose a token. The output
layer is most of a small draft's step (63% of a Gemma-3-270M step: 262k vocabulary rows
against 640 hidden units), so :class:`DraftHead` runs the model's body over every fed
position and its output layer at one position per sequence only; with a pruned vocabulary
(:mod:`polspec.decoding.draft_vocab`) it multiplies by the kept rows alone. A pruned draft
proposes only kept tokens, which stays lossless: the target verifies every candidate.
"""

from __future__ import annotations

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import mlx.core as mx
import mlx.nn as nn

from polspec.errors import PolspecError

# mlx-lm model types whose forward is exactly ``output_layer(model.model(inputs, cache))``
# (no logit scaling or soft-capping after the body), so the body and the output layer can run
# apart. Other architectures run their whole forward and keep the last position.
SPLIT_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma3_text"})


def can_split(model: nn.Module) -> bool:
    """Whether the model's body and output layer can run apart (and its vocabulary be pruned)."""
    return getattr(model, "model_type", None) in SPLIT_MODEL_TYPES


def vocabulary_size(model: nn.Module) -> int:
    """How many logits the model gives per position (its embedding rows, often more than its tokenizer's tokens)."""
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return size if isinstance(size, int) else model(mx.array([[0]])).shape[-1]


def output_layer(model: nn.Module) -> nn.Module:
    """The module that turns hidden states into logits: the tied embedding or ``lm_head``."""
    tied = getattr(model, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(model.args, "tie_word_embeddings", False)
    return model.model.embed_tokens if tied else model.lm_head


def _output_rows(layer: nn.Module, keep: mx.array) -> mx.array:
    """The output layer's weight rows for the ``keep`` token ids, as a float matrix [len(keep), hidden]."""
    if "scales" in layer:  # a quantized embedding or linear layer
        biases = layer["biases"][keep] if "biases" in layer else None
        return mx.dequantize(layer.weight[keep], layer.scales[keep], biases, group_size=layer.group_size,
                             bits=layer.bits, mode=getattr(layer, "mode", "affine"))
    return layer.weight[keep]


class DraftHead:
    """Next-token logits of a draft model at one position per sequence.

    ``keep`` (token ids) prunes the output layer to those rows; None keeps the full
    vocabulary. Logits are indexed by position in ``keep``: :meth:`vocabulary_ids` maps an
    index (an argmax) back to the token id.
    """

    def __init__(self, model: nn.Module, keep: list[int] | None = None, alias: str = "the draft"):
        self.model = model
        self.split = can_split(model)
        self.keep = None
        self.shared_drafts: dict[str, object] = {}  # target alias -> this head's SharedDraft under TLI
        if keep is not None:
            if not self.split:
                raise PolspecError(f"{alias} ({getattr(model, 'model_type', '?')}) cannot run with a pruned draft "
                                   f"vocabulary; use --draft-vocab full")
            self.keep = mx.array(sorted(keep))
            self.rows = _output_rows(output_layer(model), self.keep)
            mx.eval(self.rows)

    @property
    def size(self) -> int | None:
        """How many tokens the draft can propose; None for its full vocabulary."""
        return None if self.keep is None else self.keep.size

    def __call__(self, inputs: mx.array, cache: list, last: mx.array | None = None) -> mx.array:
        """Logits [batch, vocabulary] after feeding ``inputs`` [batch, positions] to ``cache``,
        at each row's position ``last`` (default: the final one)."""
        return self.logits(self.features(inputs, cache, last))

    def features(self, inputs: mx.array, cache: list, last: mx.array | None = None) -> mx.array:
        """What the output layer takes, at one position per row: hidden states [batch, hidden].
        The same for every head of one model, so rows with different heads share this forward.
        (For an architecture that cannot split, the full logits, which :meth:`logits` passes on.)"""
        rows = mx.arange(inputs.shape[0])
        if self.split:
            hidden = self.model.model(inputs, cache)
        else:
            hidden = self.model(inputs, cache=cache)
        return hidden[:, -1] if last is None else hidden[rows, last]

    def logits(self, features: mx.array) -> mx.array:
        """Logits over this head's vocabulary from :meth:`features`."""
        if not self.split:
            return features
        if self.keep is not None:
            return features @ self.rows.T
        layer = output_layer(self.model)
        return layer.as_linear(features) if hasattr(layer, "as_linear") else layer(features)

    def vocabulary_ids(self, indices: mx.array) -> mx.array:
        """Token ids of logit ``indices`` (the identity for the full vocabulary)."""
        return indices if self.keep is None else self.keep[indices]
