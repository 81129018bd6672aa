"""The API-independent part of a generated model.py's generation section (linen, nnx and
the JAX target's function).

Real code, linted and tested as code: :mod:`.generation` copies everything below the
``# model.py:`` marker into the generated file, with the four constants set from the
conversion, followed by the API's part (:mod:`.generate_linen`, :mod:`.generate_nnx` or
:mod:`.generate_jax`): its ``decode``, its jitted loop and its ``generate``.
"""

import jax
import jax.numpy as jnp

# model.py:
#: Per decoder layer, ((key heads, key head size), (value heads, value head size)).
CACHE_LAYOUT = (((1, 1), (1, 1)),)
#: The longest cache the source model attends over (its positions, or its sliding window).
MAX_LENGTH = None
#: The token that ends a sequence, and the one written after it (the source's config).
EOS_TOKEN_ID = None
PAD_TOKEN_ID = None


def init_cache(batch_size, max_length, dtype=jnp.float32):
    """An empty cache: per layer ``(keys, values)``, each ``(batch, heads, max_length, size)``."""
    if MAX_LENGTH is not None and max_length > MAX_LENGTH:
        raise ValueError(f"max_length {max_length} is past the model's {MAX_LENGTH} positions")
    return tuple(
        (
            jnp.zeros((batch_size, key_heads, max_length, key_size), dtype),
            jnp.zeros((batch_size, value_heads, max_length, value_size), dtype),
        )
        for (key_heads, key_size), (value_heads, value_size) in CACHE_LAYOUT
    )


def _pick(logits, key, temperature, top_k, top_p):
    """The next token of each row: the argmax at temperature 0, else a sample."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        order = jnp.argsort(-logits, axis=-1)
        ranked = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(ranked, axis=-1)
        ranked = jnp.where(jnp.cumsum(probs, axis=-1) - probs > top_p, -jnp.inf, ranked)
        rows = jnp.arange(logits.shape[0])[:, None]
        logits = jnp.full_like(logits, -jnp.inf).at[rows, order].set(ranked)
    return jax.random.categorical(key, logits, axis=-1)


def full_mask(attention_mask, batch, prompt, max_length):
    """The ``(batch, max_length)`` mask of the cache slots: the prompt's ``attention_mask``
    (0 at a left-padding slot; all ones when ``None``) followed by ones."""
    mask = jnp.ones((batch, max_length), jnp.int32)
    if attention_mask is None:
        return mask
    return mask.at[:, :prompt].set(jnp.asarray(attention_mask, jnp.int32))


def _cached_step(step, input_ids, cache_position, cache, attention_mask):
    """``step(input_ids, cache_position, attention_mask, key_0, value_0, ...)``, the converted
    function, over the cache pytree: ``(logits, cache)``. ``attention_mask`` is all ones over
    the cache when ``None``."""
    if attention_mask is None:
        attention_mask = jnp.ones((input_ids.shape[0], cache[0][0].shape[2]), jnp.int32)
    flat = [tensor for layer in cache for tensor in layer]
    logits, *flat = step(input_ids, cache_position, jnp.asarray(attention_mask, jnp.int32), *flat)
    return logits, tuple(zip(flat[0::2], flat[1::2], strict=True))


def _decode_loop(step, input_ids, attention_mask, cache, rng, max_new_tokens, temperature,
                 top_k, top_p, eos_token_id):  # fmt: skip
    """Prefill, then ``max_new_tokens - 1`` one-token steps in a ``fori_loop``;
    ``step(input_ids, cache_position, attention_mask, cache) -> (logits, cache)``."""
    batch, prompt = input_ids.shape
    logits, cache = step(input_ids, jnp.arange(prompt), attention_mask, cache)
    rng, key = jax.random.split(rng)
    token = _pick(logits[:, -1], key, temperature, top_k, top_p).astype(input_ids.dtype)
    tokens = jnp.zeros((batch, max_new_tokens), input_ids.dtype).at[:, 0].set(token)
    done = jnp.zeros((batch,), bool) if eos_token_id is None else token == eos_token_id
    pad = eos_token_id if PAD_TOKEN_ID is None else PAD_TOKEN_ID

    def one(i, state):
        tokens, cache, rng, done = state
        last = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)
        logits, cache = step(last, jnp.full((1,), prompt + i - 1), attention_mask, cache)
        rng, key = jax.random.split(rng)
        token = _pick(logits[:, -1], key, temperature, top_k, top_p).astype(tokens.dtype)
        if eos_token_id is not None:
            token = jnp.where(done, pad, token)
            done = done | (token == eos_token_id)
        return tokens.at[:, i].set(token), cache, rng, done

    tokens = jax.lax.fori_loop(1, max_new_tokens, one, (tokens, cache, rng, done))[0]
    return jnp.concatenate([input_ids, tokens], axis=1)


def _prepared(input_ids, attention_mask, max_new_tokens, temperature, rng, max_length, dtype):
    """The checked prompt, its cache mask, an empty cache for it and the PRNG key."""
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, prompt), got shape {input_ids.shape}")
    batch, prompt = input_ids.shape
    if attention_mask is not None and jnp.shape(attention_mask) != (batch, prompt):
        raise ValueError(
            f"attention_mask must be input_ids' shape {(batch, prompt)}, got "
            f"{jnp.shape(attention_mask)}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    length = max_length or prompt + max_new_tokens
    if length < prompt + max_new_tokens:
        raise ValueError(
            f"max_length {length} holds fewer than the prompt's {prompt} and "
            f"{max_new_tokens} new tokens"
        )
    if temperature and rng is None:
        raise ValueError("sampling (temperature > 0) needs rng=jax.random.key(seed)")
    rng = jax.random.key(0) if rng is None else rng
    mask = full_mask(attention_mask, batch, prompt, length)
    return input_ids, mask, init_cache(batch, length, dtype), rng


def _generated(compiled, weights, input_ids, max_new_tokens, attention_mask, temperature,
               top_k, top_p, rng, eos_token_id, max_length, dtype):  # fmt: skip
    """``compiled(*weights, input_ids, mask, cache, rng, **options)``, the API's jitted loop,
    on the checked prompt, its mask and an empty cache."""
    input_ids, mask, cache, rng = _prepared(input_ids, attention_mask, max_new_tokens,
                                            temperature, rng, max_length, dtype)  # fmt: skip
    return compiled(
        *weights, input_ids, mask, cache, rng, max_new_tokens=int(max_new_tokens),
        temperature=float(temperature), top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
    )  # fmt: skip


_STATIC = ("max_new_tokens", "temperature", "top_k", "top_p", "eos_token_id")
