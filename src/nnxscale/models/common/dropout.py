"""Dropout as nnxscale's models apply it: on the embeddings and on the residual branches
of every layer, with keys drawn from the ``rngs`` of the call (the model state holds no
RNG state), and only when a call gets ``rngs`` and the rate is positive."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx


def dropout(x, rate: float, key):
    """Inverted dropout; the identity when ``key`` is None."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def dropout_keys(rngs: Optional[nnx.Rngs], rate: float, n_layers: int):
    """``(embedding key, per-layer keys (n_layers, ...))`` from the ``dropout`` stream of
    ``rngs`` (or ``default``); ``(None, None)`` without ``rngs`` or at rate 0."""
    if rngs is None or rate == 0:
        return None, None
    keys = jax.random.split(rngs.dropout(), n_layers + 1)
    return keys[0], keys[1:]
