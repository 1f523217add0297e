"""polspec: cross-tokenizer speculative decoding for Polish language models on MLX."""

__version__ = "0.1.0"
