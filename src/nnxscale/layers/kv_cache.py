"""The key/value cache of autoregressive decoding: each new token costs one position's work.

A model that decodes with a cache keeps, for every attention layer, the keys and values of
the tokens it has seen, ``(B, S, K, H)`` each, and per call computes only the new tokens'.
For stacked layers the cache is one pytree with a leading ``layers`` axis, scanned beside
the layers' parameters (:func:`nnxscale.scan_layers` with ``cache=``).

Positions are the cache's index: the token at position ``p`` of row ``b`` is stored at
``[b, p]``. A call writes its tokens at their positions (contiguous per row, possibly a
different start in each row) and attends causally over the whole cache, so slots beyond a
query's position, empty or left over from padding, are never seen. Prompts of different
lengths are therefore right-padded and prefilled together: a padded slot is overwritten by
the row's next real token before any query can see it.

Model code::

    def __call__(self, x, positions=None, segments=None, cache=None):
        q, k, v = ...
        if cache is not None:
            k, v, cache = kv_cache.write(cache, k, v, positions)
            y = kv_cache.attend(q, k, v, positions, impl=self.impl)
            return self.out(y), cache
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nnxscale.layers.attention import AUTO_BLOCKWISE_FROM
from nnxscale.layers.attention import attention as _attention
from nnxscale.sharding.activations import constrain


def empty(layers: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype, heads_name: str = "kv_heads") -> dict:
    """A zero cache ``{"k", "v"}`` of ``(layers, batch, length, kv_heads, head_dim)`` each,
    laid out by the activation rules in force (``heads_name``: the logical name of the
    key/value heads, ``heads`` for a model whose keys have one head per query head)."""
    shape = (layers, batch, length, kv_heads, head_dim)
    names = ("layers", "batch", None, heads_name, "kv")
    return {name: constrain(jnp.zeros(shape, dtype), *names) for name in ("k", "v")}


def write(cache: dict, k, v, positions):
    """Store ``k, v (B, T, K, H)`` of tokens at ``positions (B, T)`` (contiguous in each row)
    in one layer's ``cache`` ``{"k", "v"}: (B, S, K, H)``; returns ``(keys, values, cache)``,
    the first two the whole cache's ``(B, S, K, H)``."""
    start = positions[:, 0]
    put = jax.vmap(lambda c, new, s: jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), s, axis=0))
    new = {"k": put(cache["k"], k, start), "v": put(cache["v"], v, start)}
    return new["k"], new["v"], new


def attend(q, k, v, positions, *, impl: str = "auto"):
    """Causal attention of queries ``q (B, T, N, H)`` at ``positions (B, T)`` over a whole
    cache ``k, v (B, S, K, H)`` (slot ``s`` holds position ``s``). ``impl``: the layer's
    attention implementation; ``auto`` and the kernels (``cudnn``, ``splash``, ``pallas-gpu``)
    become ``xla`` (one query per row when decoding) or ``blockwise`` for prompts of
    :data:`~nnxscale.layers.attention.AUTO_BLOCKWISE_FROM` tokens and more, as a cache needs
    positions, which the kernels' paths here do not take."""
    T = q.shape[1]
    if impl not in ("xla", "blockwise"):
        impl = "blockwise" if T >= AUTO_BLOCKWISE_FROM else "xla"
    return _attention(q, k, v, causal=True, q_positions=positions, k_positions=None, impl=impl)
