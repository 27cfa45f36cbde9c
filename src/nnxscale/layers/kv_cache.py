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

Layers with a sliding window, a soft cap, a scale of their own or values of another width
(Mistral, Gemma 2/3, DeepSeek) call :func:`step`, which writes and attends in one, passing
the switches on to :func:`~nnxscale.layers.attention.attention`::

            y, cache = kv_cache.step(cache, q, k, v, positions, impl=self.impl, window=self.window,
                                     softcap=self.softcap, scale=self.scale)

A layer with a window sees no more than ``window`` positions back, so its cache need hold no
more: :func:`empty` with ``window`` smaller than ``length`` makes a *ring* of ``window`` slots
(``{"k", "v", "pos"}``), where position ``p`` lives in slot ``p % window`` and ``"pos"``
``(layers, batch, window)`` int32 records which position each slot holds (-1: none yet).
:func:`step` on a ring attends over the ring's keys and the new tokens' together, each key
masked by its recorded position (causal and within the window; slots holding a position at or
after the row's first new token are stale and hidden), then writes the new tokens into their
slots, so the ring keeps each row's last ``window`` positions. A prefill longer than the
window works (only its last ``window`` tokens are kept). As everywhere here, positions are
contiguous per row and rows may start at different positions; but the ring keeps the last
tokens *written*, so padding written after a row's real tokens (right-padded prompts of
different lengths prefilled together) would push the row's real tokens out of its window:
prefill a ring with each row's real tokens only (for instance rows of equal length, or one
call per length).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from nnxscale.layers.attention import AUTO_BLOCKWISE_FROM
from nnxscale.layers.attention import attention as _attention
from nnxscale.sharding.activations import constrain

#: The position given to a ring's empty or stale slots: past every query, so the causal mask hides it.
_UNSEEN = 2**30


def empty(layers: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype, heads_name: str = "kv_heads", *,
          window: Optional[int] = None, v_head_dim: Optional[int] = None) -> dict:  # fmt: skip
    """A zero cache ``{"k", "v"}`` of ``(layers, batch, length, kv_heads, head_dim)`` each,
    laid out by the activation rules in force (``heads_name``: the logical name of the
    key/value heads, ``heads`` for a model whose keys have one head per query head).
    ``v_head_dim``: the values' width where it is not the keys'. ``window`` smaller than
    ``length``: a ring of ``window`` slots and their positions ``"pos"`` ``(layers, batch,
    window)`` int32, -1 where empty (module docstring)."""
    slots = length if window is None or window >= length else window
    names = ("layers", "batch", None, heads_name, "kv")
    widths = {"k": head_dim, "v": head_dim if v_head_dim is None else v_head_dim}
    cache = {name: constrain(jnp.zeros((layers, batch, slots, kv_heads, width), dtype), *names)
             for name, width in widths.items()}  # fmt: skip
    if slots < length:
        cache["pos"] = constrain(jnp.full((layers, batch, slots), -1, jnp.int32), "layers", "batch", None)
    return cache


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
    return _attention(q, k, v, causal=True, q_positions=positions, k_positions=None, impl=_impl(impl, q.shape[1]))


def _impl(impl: str, tokens: int) -> str:
    if impl in ("xla", "blockwise"):
        return impl
    return "blockwise" if tokens >= AUTO_BLOCKWISE_FROM else "xla"


def step(cache: dict, q, k, v, positions, *, impl: str = "auto", window: Optional[int] = None,
         softcap: Optional[float] = None, scale: Optional[float] = None):  # fmt: skip
    """Write the new tokens' ``k (B, T, K, H)``, ``v (B, T, K, Hv)`` at ``positions (B, T)``
    (contiguous per row) into one layer's ``cache`` and attend with the queries
    ``q (B, T, N, H)``: ``(y (B, T, N, Hv), new cache)``. A whole cache (``{"k", "v"}``) is
    :func:`write` and :func:`attend`; a ring (``{"k", "v", "pos"}``, :func:`empty` with a
    window) attends over its recorded positions and the new tokens, then keeps the last
    ``window`` positions. ``window``, ``softcap``, ``scale``: as
    :func:`~nnxscale.layers.attention.attention` takes them (a ring needs its window, no
    larger than its slots). ``impl``: as :func:`attend` takes it."""
    impl, switches = _impl(impl, q.shape[1]), dict(window=window, softcap=softcap, scale=scale)
    if "pos" not in cache:
        keys, values, new = write(cache, k, v, positions)
        return _attention(q, keys, values, causal=True, q_positions=positions, impl=impl, **switches), new
    slots = cache["pos"].shape[1]
    if window is None or window > slots:
        raise ValueError(f"a ring cache of {slots} slots serves a window of at most {slots} tokens, got {window}")
    old = cache["pos"]
    # Slots at or after the row's first new position hold stale tokens (padding written
    # before): the new tokens take their place. Empty slots (-1) are hidden alike.
    old = jnp.where((old >= 0) & (old < positions[:, :1]), old, _UNSEEN)
    keys = jnp.concatenate([cache["k"], k.astype(cache["k"].dtype)], axis=1)
    values = jnp.concatenate([cache["v"], v.astype(cache["v"].dtype)], axis=1)
    k_positions = jnp.concatenate([old, positions.astype(jnp.int32)], axis=1)
    y = _attention(q, keys, values, causal=True, q_positions=positions, k_positions=k_positions, impl=impl, **switches)
    return y, _ring_write(cache, k, v, positions)


def _ring_write(cache: dict, k, v, positions) -> dict:
    """The ring ``cache`` with the last ``slots`` of the new tokens in slots ``position % slots``
    (distinct: their positions are contiguous), each slot's position recorded."""
    slots, T = cache["pos"].shape[1], positions.shape[1]
    kept = min(T, slots)
    where = positions[:, T - kept :] % slots  # (B, kept)
    put = jax.vmap(lambda c, i, new: c.at[i].set(new.astype(c.dtype)))
    return {
        "k": put(cache["k"], where, k[:, T - kept :]),
        "v": put(cache["v"], where, v[:, T - kept :]),
        "pos": put(cache["pos"], where, positions[:, T - kept :]),
    }
