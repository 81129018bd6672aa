"""The nnx part of a generated model.py's generation section (see :mod:`.generate_common`).

``Model`` there is the converted cached step holding its variables: ``model(input_ids,
cache_position, attention_mask, key_0, value_0, key_1, ...)`` returns the logits and the
updated cache tensors in that order.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from xconv.converters.flax.source.generate_common import (
    _STATIC,
    EOS_TOKEN_ID,
    _cached_step,
    _decode_loop,
    _generated,
)

# model.py:


def decode(model, input_ids, cache_position, cache, attention_mask=None):
    """One cached step, prefill (many tokens) or decode (one): ``(logits, cache)``.

    ``input_ids`` is ``(batch, seq)``; ``cache_position`` ``(seq,)`` holds the cache slots the
    tokens are written to. ``attention_mask`` ``(batch, max_length)`` marks each row's
    padding slots with 0 (a left-padded prompt; all ones when ``None``): a token's position
    is the count of unmasked slots before it, and no token attends to a padding slot.
    """
    return _cached_step(model, input_ids, cache_position, cache, attention_mask)


@functools.partial(jax.jit, static_argnames=("graphdef", *_STATIC))
def _generate(graphdef, state, input_ids, attention_mask, cache, rng, **options):
    model = nnx.merge(graphdef, state)

    def step(input_ids, cache_position, attention_mask, cache):
        return decode(model, input_ids, cache_position, cache, attention_mask)

    return _decode_loop(step, input_ids, attention_mask, cache, rng, **options)


def generate(model, input_ids, max_new_tokens, *, attention_mask=None, temperature=0.0,
             top_k=None, top_p=None, rng=None, eos_token_id=EOS_TOKEN_ID, max_length=None,
             dtype=jnp.float32):  # fmt: skip
    """``input_ids`` ``(batch, prompt)`` followed by ``max_new_tokens`` generated tokens.

    Greedy at ``temperature=0`` (the default), else sampled with the JAX PRNG key ``rng``
    after ``top_k`` / ``top_p`` filtering. A row that emits ``eos_token_id`` continues with
    the pad token. ``attention_mask`` ``(batch, prompt)`` (0 at padding) lets a batch hold
    prompts of different lengths, left-padded. Prefill and the decode loop run as one
    compiled program; each new token is one cached decode step (the cache holds
    ``max_length`` positions, by default the prompt and the new tokens).
    """
    return _generated(_generate, nnx.split(model), input_ids, max_new_tokens, attention_mask,
                      temperature, top_k, top_p, rng, eos_token_id, max_length, dtype)  # fmt: skip
