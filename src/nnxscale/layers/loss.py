"""A next-token loss that never holds all the logits: the head and the cross-entropy run
over chunks of tokens.

The logits of a long sequence are the largest activation of a language model: ``(tokens x
vocabulary)`` float32, 8.4 GB for one 16,384-token sequence of Llama 3's 128,256-token
vocabulary, and as much again for their gradient. :func:`chunked_cross_entropy` computes
them one chunk of tokens at a time inside a ``lax.scan`` whose body is rematerialized
(``jax.checkpoint``): the forward keeps only each chunk's loss, the backward recomputes one
chunk's logits, takes their gradient and moves on. Chunk ``i`` holds tokens ``i, i + n,
i + 2n, ...`` (a stride, not a slice), so a sequence split over devices (``length`` on a
``context`` axis) is chunked where it lies, with no data moved.

The number of chunks is the smallest divisor of the sequence length that keeps one
chunk's logits under :data:`CHUNK_BYTES` per device; short sequences take one chunk, which
is the plain computation.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from nnxscale.sharding.activations import current_rules

#: One chunk's float32 logits, per device, stay under this.
CHUNK_BYTES = 256 << 20


def chunk_count(batch: int, length: int, vocab: int, shards: int = 1, budget: Optional[int] = None) -> int:
    """The fewest chunks (a divisor of ``length``) whose logits fit ``budget`` bytes per device,
    when the tokens are split ``shards`` ways."""
    budget = CHUNK_BYTES if budget is None else budget
    return fewest_chunks(length, batch * length * vocab * 4 / max(shards, 1), budget)


def fewest_chunks(size: int, nbytes: float, budget: int) -> int:
    """The fewest chunks, a divisor of ``size``, that cut ``nbytes`` to at most ``budget`` each
    (``size`` chunks when none does)."""
    need = math.ceil(nbytes / budget)
    return next((d for d in range(max(need, 1), size + 1) if size % d == 0), size)


def token_shards() -> int:
    """How many ways the activation rules in force split the tokens (batch and length)."""
    rules = current_rules()
    if rules is None:
        return 1
    return rules.batch_shard_count * rules.length_shard_count


def context_order(length: int):
    """The zigzag order of a sequence of ``length`` tokens when the rules in force split it
    over a ``context`` axis (:func:`nnxscale.layers.attention.zigzag`); None otherwise."""
    rules = current_rules()
    n = rules.length_shard_count if rules is not None else 1
    if n <= 1:
        return None
    from nnxscale.layers.attention import zigzag

    order = zigzag(length, n)
    return None if (order == np.arange(length)).all() else order


def chunked_cross_entropy(
    hidden, targets, project: Callable, *, weights=None, chunks: Optional[int] = None, vocab: Optional[int] = None
) -> jax.Array:
    """Mean next-token cross-entropy of ``project(hidden)`` against ``targets``, in chunks.

    ``hidden`` ``(B, T, C)``: the model's last hidden states; ``project`` maps ``(B, t, C)``
    to float32 logits ``(B, t, V)`` (the output head, which constrains its logits' layout:
    a chunk's logits are split like the whole's); ``targets`` ``(B, T)`` ints;
    ``weights`` ``(B, T)`` (optional): each token's weight, the mean is over their sum.
    ``chunks``: default :func:`chunk_count`, for ``vocab`` words (default: traced from
    ``project`` on one token, which records that token's logits among the activations).
    """
    B, T, C = hidden.shape
    w = jnp.ones((B, T), jnp.float32) if weights is None else weights.astype(jnp.float32)
    if chunks is None:
        if vocab is None:
            vocab = jax.eval_shape(project, jax.ShapeDtypeStruct((B, 1, C), hidden.dtype)).shape[-1]
        chunks = chunk_count(B, T, vocab, token_shards())
    if T % chunks:
        raise ValueError(f"{chunks} chunks do not divide the {T} tokens of a sequence")

    def token_losses(x, t):  # (B, t, C), (B, t) -> (B, t)
        return optax.softmax_cross_entropy_with_integer_labels(project(x).astype(jnp.float32), t)

    if chunks == 1:  # the plain computation, as next_token_loss writes it
        losses = token_losses(hidden, targets)
        return losses.mean() if weights is None else jnp.sum(losses * w) / jnp.sum(w)

    @jax.checkpoint
    def body(total, xs):
        x, t, wi = xs
        return total + jnp.sum(token_losses(x, t) * wi), None

    xs = (strided(hidden, chunks), strided(targets, chunks), strided(w, chunks))
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
    return total / jnp.sum(w)


def strided(a, chunks: int):
    """``(B, T, ...) -> (chunks, B, T / chunks, ...)``: chunk ``i`` holds tokens ``i, i + n, ...``."""
    B, T = a.shape[:2]
    return jnp.moveaxis(a.reshape(B, T // chunks, chunks, *a.shape[2:]), 2, 0)

