r"""Text from a trained language model (the lm trainer's workdir), with a KV cache.

    python -m skipless_jax.generate --workdir=DIR --prompt="def " --max_new_tokens=200 \
        [--temperature=0.8 --top_k=40 --seed=0]

The model and its parameters are the newest checkpoint's (its saved config). The context is
END_OF_DOCUMENT followed by the prompt's tokens (its UTF-8 bytes, or the run's SentencePiece
ids): a document starts after that token in the training stream. The prompt goes through the
model once, filling each attention's cache; then each new token is one call of one compiled
step that attends over the cache (no recompute of the prefix). Past the context: when the
cache's `seq_len` positions are full, the window moves to the last seq_len − 1 tokens and the
cache is filled again from them (docs/method/lm.md §2, nanoGPT's crop), so `--max_new_tokens`
has no upper bound. Sampling: softmax(logits /
temperature) over the `top_k` most likely tokens (0: all); temperature 0 is greedy. The text
(prompt + continuation) is printed. Bad flags and a workdir without an lm checkpoint are one
`error: ...` line, exit status 2.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

from absl import flags


def check_sampling(max_new_tokens: int, temperature: float, top_k: int) -> None:
    """One-line ValueError for a bad sampling setting."""
    import math

    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens={max_new_tokens} must be at least 1")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature={temperature} must be a finite number >= 0 (0: greedy)")
    if top_k < 0:
        raise ValueError(f"--top_k={top_k} must be >= 0 (0: every token)")


def load(workdir: str) -> tuple[Any, Any]:
    """(the saved config, the newest checkpoint's parameters, unrolled) of an lm workdir; a
    one-line ValueError when it holds no lm checkpoint."""
    import ml_collections

    from skipless_jax import checkpoint, trainers
    from skipless_jax.models import vit

    if not os.path.isdir(workdir):
        raise ValueError(f"--workdir={workdir}: no such directory")
    saved = checkpoint.saved_config(workdir)
    if saved is None:
        raise ValueError(f"--workdir={workdir} holds no checkpoint with a saved config (train it first)")
    if trainers.of_config(saved).inputs != "tokens":
        raise ValueError(f"--workdir={workdir} is a {trainers.name_of(saved)!r} run; "
                         "generation needs an lm run (config.trainer='lm')")
    _, state = checkpoint.load_raw(workdir)
    return ml_collections.ConfigDict(saved), vit.unstack_blocks(state["params"])


def decoder(model_config: Any, vocab_size: int, decode: bool = True) -> Any:
    """The run's GPT, unrolled (no scan, no remat), with the KV cache when `decode`."""
    import ml_collections

    from skipless_jax import models

    cfg = ml_collections.ConfigDict(model_config.to_dict())
    cfg.update(dict(scan=False, remat=None, attention_impl=None, dropout=0.0, drop_path=0.0, decode=decode))
    return models.build(cfg, vocab_size)


def sample(logits: Any, key: Any, temperature: float, top_k: int) -> Any:
    """(B, V) float32 logits -> (B,) tokens: argmax at temperature 0, else a draw from
    softmax(logits / temperature) restricted to the `top_k` largest (0: all)."""
    import jax
    import jax.numpy as jnp

    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def window_start(start: int, length: int, seq_len: int) -> int:
    """Where the window of a sequence of `length` tokens starts (docs/method/lm.md §2): `start`
    while it holds at most `seq_len` tokens, else the last seq_len − 1 tokens."""
    return start if length - start <= seq_len else length - (seq_len - 1)


def generate(model: Any, params: Any, context: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0) -> list[int]:
    """The `max_new_tokens` tokens after `context` (a decode=True GPT): the window's tokens fill a
    fresh cache in one call, then one compiled step per new token; past `model.seq_len` tokens
    the window moves (`window_start`) and the cache is filled again. Token i is drawn with
    fold_in(key, i)."""
    import jax
    import jax.numpy as jnp

    length = model.seq_len
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, length), jnp.int32)))
    key = jax.random.PRNGKey(seed)

    def forward(cache, tokens):
        (logits, _), updated = model.apply({"params": params, "cache": cache}, tokens, mutable=["cache"])
        return logits[:, -1], updated["cache"]

    @jax.jit
    def fill(tokens, i):  # a fresh cache from the window's tokens; one program per window length
        cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])
        logits, cache = forward(cache, tokens)
        return cache, sample(logits, jax.random.fold_in(key, i), temperature, top_k)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, token, i):
        logits, cache = forward(cache, token[:, None])
        return cache, sample(logits, jax.random.fold_in(key, i), temperature, top_k)

    tokens = list(context)
    start = window_start(0, len(tokens), length)
    cache, token = fill(jnp.asarray([tokens[start:]], jnp.int32), 0)
    for i in range(1, max_new_tokens + 1):
        tokens.append(int(token[0]))
        if i == max_new_tokens:
            break
        moved = window_start(start, len(tokens), length)
        if moved == start:
            cache, token = step(cache, token, i)
        else:
            start = moved
            cache, token = fill(jnp.asarray([tokens[start:]], jnp.int32), i)
    return tokens[len(context):]


def generate_by_recompute(model: Any, params: Any, context: Sequence[int], max_new_tokens: int,
                          temperature: float = 0.0, top_k: int = 0, seed: int = 0) -> list[int]:
    """`generate` without a cache (a decode=False GPT): each token from its whole window again,
    the window moving by the same rule (the reference the cache must equal)."""
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(seed)
    last = jax.jit(lambda tokens: model.apply({"params": params}, tokens)[0][:, -1])  # one program per length
    tokens = list(context)
    start = window_start(0, len(tokens), model.seq_len)
    for i in range(max_new_tokens):
        logits = last(jnp.asarray([tokens[start:]], jnp.int32))
        tokens.append(int(sample(logits, jax.random.fold_in(key, i), temperature, top_k)[0]))
        start = window_start(start, len(tokens), model.seq_len)
    return tokens[len(context):]


def main(argv: Sequence[str]) -> None:
    from skipless_jax import cli

    if len(argv) > 1:
        cli.usage_error(f"unexpected argument {argv[1]!r}; flags are written --name=value (see --help)")
    f = flags.FLAGS
    if not f.workdir:
        cli.usage_error("--workdir=DIR is required: the lm run to generate from (see --help)")
    try:
        check_sampling(f.max_new_tokens, f.temperature, f.top_k)
    except ValueError as err:
        cli.usage_error(str(err))
    cli.quiet_console()
    from skipless_jax.data import text

    try:
        config, params = load(f.workdir)
        tok = text.tokenizer(config)  # the run's: bytes, or its SentencePiece model
        context = [tok.end_of_document, *tok.encode(f.prompt.encode("utf-8")).tolist()]
        new = generate(decoder(config.model, tok.vocab_size), params, context, f.max_new_tokens, f.temperature,
                       f.top_k, f.seed)
    except (ValueError, FileNotFoundError) as err:
        cli.usage_error(str(err))
    print(f.prompt + tok.decode(new), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":  # the flags are defined here, as evaluate's: importing the module defines none
    from absl import app

    from skipless_jax import cli

    flags.DEFINE_string("workdir", None, "The lm run's workdir (required).")
    flags.DEFINE_string("prompt", "", "The text the continuation follows.")
    flags.DEFINE_integer("max_new_tokens", 200, "Tokens (bytes) to generate.")
    flags.DEFINE_float("temperature", 0.8, "Softmax temperature (0: greedy).")
    flags.DEFINE_integer("top_k", 40, "Sample among the k most likely tokens (0: all).")
    flags.DEFINE_integer("seed", 0, "The sampling seed.")

    app.run(main, flags_parser=cli.parse_flags)
