"""``polspec generate``: one prompt, streamed to the terminal as it is generated."""

from __future__ import annotations

import json

import click

from polspec.errors import PolspecError

DEFAULT_TARGET = "gemma3-270m"


@click.command()
@click.argument("prompt")
@click.option("--target", default=DEFAULT_TARGET, show_default=True, help="Model alias that writes the text.")
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(min=1), help="Tokens to generate at most.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0.0),
              help="0 is greedy decoding.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True),
              help="Nucleus sampling mass.")
@click.option("--seed", type=int, help="Random seed for sampling.")
@click.option("--raw", is_flag=True, help="Continue PROMPT as plain text instead of applying the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the text, token ids and timings.")
def generate(prompt: str, target: str, max_tokens: int, temperature: float, top_p: float,
             seed: int | None, raw: bool, as_json: bool) -> None:
    """Generate a continuation of PROMPT with the target model (target-only decoding).

    \b
    Examples:
      polspec generate "Kraków jest"
      polspec generate "Napisz haiku o Wiśle." --target qwen2.5-coder-1.5b --max-tokens 64
    """
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from polspec.models.loader import load_model

    if not prompt.strip():
        raise PolspecError("the prompt is empty")
    loaded = load_model(target)
    tokenizer = loaded.tokenizer
    chat = loaded.entry.chat_template and not raw
    if chat:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    else:
        prompt_ids = tokenizer.encode(prompt)
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp=temperature, top_p=top_p if top_p < 1.0 else 0.0)
    tokens, pieces, last = [], [], None
    for last in stream_generate(loaded.model, tokenizer, prompt_ids, max_tokens=max_tokens, sampler=sampler):
        if last.finish_reason != "stop":
            tokens.append(last.token)
        pieces.append(last.text)
        if not as_json:
            click.echo(last.text, nl=False)
    text = "".join(pieces)
    if as_json:
        click.echo(json.dumps({
            "target": target, "dtype": loaded.dtype, "chat_template": chat, "text": text, "token_ids": tokens,
            "prompt_tokens": last.prompt_tokens, "generated_tokens": last.generation_tokens,
            "prefill_tokens_per_s": round(last.prompt_tps, 2), "decode_tokens_per_s": round(last.generation_tps, 2),
            "peak_memory_gb": round(last.peak_memory, 3), "finish_reason": last.finish_reason,
        }, ensure_ascii=False))
    else:
        click.echo()
