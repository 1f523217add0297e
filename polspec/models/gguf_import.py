"""Import a GGUF file into an MLX model directory that ``mlx_lm.load`` opens, without torch.

Reading and dequantizing (every quant type, K-quants included) is the ``gguf`` package's job;
the tokenizer is rebuilt with transformers' GGUF tokenizer mapping. What is left here is the
part no library does for MLX: the config per architecture, the tensor names, and the weight
conventions that llama.cpp changed when it wrote the file:

- llama architecture: Q and K rows were permuted for interleaved rotary embeddings;
- gemma3: every RMSNorm weight was stored plus one;
- tied embeddings: no ``output.weight`` tensor, so the config ties the head to the embedding.

The output directory holds ``config.json``, float32 ``model-*.safetensors`` shards (exact
dequantized values; the loader applies the dtype policy), the tokenizer files and
``polspec-import.json`` describing the source file.
"""

from __future__ import annotations

import errno
import importlib
import json
import re
import shutil
from pathlib import Path

from polspec import backend  # noqa: F401  (before mlx: the Linux BLAS fix)

import gguf
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from polspec.errors import PolspecError
from polspec.models.fetch import ProgressFn, move_into_cache, no_progress, work_dir
from polspec.models.files import IMPORT_FORMAT, require_gguf_magic

SHARD_BYTES = 2 << 30

# GGUF architecture -> mlx-lm model type
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}

# GGUF tensor name (with {i} for the block) -> mlx-lm parameter name, per architecture
_COMMON = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
    "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
    "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
    "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
    "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
    "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
    "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
    "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
}
TENSOR_NAMES = {
    "llama": {**_COMMON, "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm"},
    "qwen2": {**_COMMON, "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm"},
    "gemma3": {
        **_COMMON,
        "blk.{i}.attn_q_norm": "model.layers.{i}.self_attn.q_norm",
        "blk.{i}.attn_k_norm": "model.layers.{i}.self_attn.k_norm",
        "blk.{i}.post_attention_norm": "model.layers.{i}.post_attention_layernorm",
        "blk.{i}.ffn_norm": "model.layers.{i}.pre_feedforward_layernorm",
        "blk.{i}.post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm",
    },
}
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def open_gguf(path: Path) -> gguf.GGUFReader:
    """Open and validate a GGUF file; a bad file is a one-line error naming it."""
    require_gguf_magic(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the reader raises bare ValueError/IndexError on short files
        raise PolspecError(f"{path}: truncated or corrupt GGUF ({type(error).__name__}: {error})") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    size = path.stat().st_size
    if end > size:
        raise PolspecError(f"{path}: truncated GGUF: tensor data needs {end} bytes, file has {size}")
    return reader


def metadata(reader: gguf.GGUFReader) -> dict:
    """All scalar and array metadata as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def architecture_of(meta: dict, path: Path) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise PolspecError(
            f"{path}: unsupported architecture {arch!r}; polspec imports {', '.join(sorted(ARCHITECTURES))}"
        )
    return arch


def build_config(arch: str, meta: dict, tensor_names: set[str], path: Path) -> dict:
    """The mlx-lm (and transformers-compatible) config for the file ``path``."""

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise PolspecError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    if "tokenizer.ggml.tokens" not in meta:
        raise PolspecError(f"{path}: no tokenizer in this GGUF (tokenizer.ggml.tokens): polspec imports whole "
                           "models, not adapters or weights alone")

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    config = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", hidden // heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "max_position_embeddings": key("context_length"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
    }
    if "rope_freqs.weight" in tensor_names:
        raise PolspecError(f"{path}: GGUF files with a rope_freqs tensor (Llama-3 rope scaling) are not "
                           "supported yet")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {"type": scaling, "rope_type": scaling, "factor": key("rope.scaling.factor")}
    if arch == "gemma3":
        config.update(
            query_pre_attn_scalar=config["head_dim"],  # what llama.cpp uses for gemma3 below 27B
            sliding_window=key("attention.sliding_window"),
            sliding_window_pattern=6,  # fixed by the architecture; llama.cpp hard-codes it too
            rope_local_base_freq=10000.0,
        )
    return config


def tokenizer_dict(meta: dict) -> dict:
    """The tokenizer description transformers' GGUF tokenizer mapping expects."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    return {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}


def build_tokenizer(arch: str, meta: dict):
    """A fast tokenizer with the file's special tokens and chat template."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    description = tokenizer_dict(meta)
    backend_tokenizer, _ = convert_gguf_tokenizer(arch, description)
    if description.get("pre_tokenizer_type") == "smollm":
        # llama.cpp's "smollm" pre-tokenizer splits digits one by one before the GPT-2 regex,
        # as SmolLM2's own tokenizer.json does; transformers' mapping has no entry for it.
        backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    tokens = description["tokens"]

    def token(name: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{name}")
        return tokens[index] if index is not None else None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend_tokenizer,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )


def _mlx_parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the mlx-lm model this config builds (no weights computed)."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    return {name: tuple(value.shape) for name, value in tree_flatten(model.parameters())}


def _mlx_name(arch: str, gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    match = _BLOCK.match(base)
    pattern = _BLOCK.sub("blk.{i}.", base) if match else base
    target = TENSOR_NAMES[arch].get(pattern)
    if target is None:
        return None
    return target.format(i=match.group(1) if match else "") + "." + suffix


def _unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary halves -> HF layout)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def convert_tensor(arch: str, config: dict, tensor) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 in HF/mlx-lm layout."""
    weight = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    weight = weight.reshape(tuple(reversed([int(d) for d in tensor.shape])))
    if arch == "llama" and tensor.name.endswith("attn_q.weight"):
        weight = _unpermute_rows(weight, config["num_attention_heads"])
    elif arch == "llama" and tensor.name.endswith("attn_k.weight"):
        weight = _unpermute_rows(weight, config["num_key_value_heads"])
    elif arch == "gemma3" and tensor.name.endswith("norm.weight"):
        weight = weight - 1.0
    return weight


def _write_weights(arch: str, config: dict, reader: gguf.GGUFReader, dest: Path, progress: ProgressFn) -> None:
    expected = _mlx_parameter_shapes(config)
    if config["tie_word_embeddings"]:
        expected.pop("lm_head.weight", None)
    shard: dict[str, mx.array] = {}
    shard_bytes, shard_index, seen = 0, 0, set()
    total = len(reader.tensors)

    def flush() -> None:
        nonlocal shard, shard_bytes, shard_index
        if shard:
            mx.save_safetensors(str(dest / f"model-{shard_index:05d}.safetensors"), shard, metadata={"format": "mlx"})
            shard, shard_bytes, shard_index = {}, 0, shard_index + 1

    for done, tensor in enumerate(reader.tensors):
        progress(f"importing {tensor.name}", done, total)
        name = _mlx_name(arch, tensor.name)
        if name is None or name not in expected:
            raise PolspecError(f"GGUF tensor {tensor.name} has no place in the {config['model_type']} model")
        weight = convert_tensor(arch, config, tensor)
        if weight.shape != expected[name]:
            raise PolspecError(f"GGUF tensor {tensor.name} has shape {weight.shape}, the model expects {expected[name]}")
        shard[name] = mx.array(weight)
        seen.add(name)
        shard_bytes += weight.nbytes
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    missing = sorted(set(expected) - seen)
    if missing:
        raise PolspecError(f"GGUF file lacks {len(missing)} tensors the model needs, e.g. {missing[0]}")
    progress("imported weights", total, total)


def import_gguf(path: Path, dest: Path, sha256: str, progress: ProgressFn = no_progress) -> Path:
    """Import the GGUF file at ``path`` into the model directory ``dest`` (created atomically).

    Nothing is left at ``dest`` unless the whole import succeeded. The caller holds ``dest``'s
    :func:`~polspec.models.fetch.cache_lock`.
    """
    reader = open_gguf(path)
    meta = metadata(reader)
    arch = architecture_of(meta, path)
    tensor_names = {t.name for t in reader.tensors}
    config = build_config(arch, meta, tensor_names, path)
    try:
        tokenizer = build_tokenizer(arch, meta)
    except Exception as error:  # transformers' converter raises what it meets in the file's metadata
        raise PolspecError(f"{path}: cannot build its tokenizer ({type(error).__name__}: {error})") from None
    work = work_dir(dest.parent, "import")
    try:
        tokenizer.save_pretrained(work)
        _write_weights(arch, config, reader, work, progress)
        (work / "config.json").write_text(json.dumps(config, indent=2))
        info = {
            "format": IMPORT_FORMAT,
            "source_file": str(path),
            "sha256": sha256,
            "architecture": arch,
            "file_type": meta.get("general.file_type"),
            "name": meta.get("general.name"),
            "has_chat_template": bool(meta.get("tokenizer.chat_template")),
        }
        (work / "polspec-import.json").write_text(json.dumps(info, indent=2))
        move_into_cache(work, dest)
    except Exception as error:
        if not _out_of_space(error):
            raise
        reason = error.strerror if isinstance(error, OSError) else str(error)
        raise PolspecError(f"cannot write the import of {path.name} into {dest.parent} (is the disk full?): "
                           f"{reason}; partial files were removed") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def _out_of_space(error: Exception) -> bool:
    """Whether a write failed for want of space: an OSError says so by its errno; the
    tokenizers library (Rust) by its message, and MLX's safetensors writer only as a short write."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    message = str(error)
    return "os error 28" in message or "os error 122" in message or message.startswith("[write] Unable to write")
