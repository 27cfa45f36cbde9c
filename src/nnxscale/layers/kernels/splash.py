"""TPU: the Pallas splash attention kernel shipped in JAX, in nnxscale's layout.

``jax.experimental.pallas.ops.tpu.splash_attention`` computes attention tile by tile in
the TPU's vector memory with an online softmax, skips the tiles its mask hides entirely
(about half under a causal mask), and has its own backward kernels (dq, and dk/dv). It takes
one sequence at a time with the heads first, ``q (N, T, H)`` and ``k, v (K, S, H)``: its
multi-head kernel reads key/value head ``n // (N / K)`` for query head ``n``, which is
grouped-query attention as nnxscale defines it. The mask is static (causal or full, by
position in the sequence) and document ids are ``SegmentIds``, so document masks cost no
``(T, S)`` array either. It does not scale the scores: the queries are scaled before.

The switches of :func:`~nnxscale.layers.attention.attention`: a sliding window is splash's
``LocalMask`` with the window ``(window - 1, 0)`` (causal local attention, one static mask
whose hidden tiles the kernel skips as it skips the causal mask's); ``softcap`` is its
``attn_logits_soft_cap`` (applied to the scaled scores, as Gemma 2 defines it); ``scale`` scales
the queries; values of another width than the keys it takes as they are (its kernels read the
values' width apart from the keys').
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from nnxscale.layers.kernels import pad_tokens, padded

#: Tokens per tile of queries and of keys (fewer for a shorter sequence, in whole lanes of 128).
BLOCK = 512
_LANES = 128  # the kernel's key tiles are whole multiples of the TPU's 128 lanes


def tile(n: int, block: Optional[int] = None) -> int:
    """The tile for a sequence of ``n`` tokens: ``block`` (default :data:`BLOCK`), or ``n``
    rounded up to whole lanes when shorter."""
    return min(block or BLOCK, padded(n, _LANES))


def splash_attention(q, k, v, q_segments=None, k_segments=None, *, causal: bool = True,
                     block: Optional[int] = None, interpret: bool = False, window: Optional[int] = None,
                     softcap: Optional[float] = None, scale: Optional[float] = None):  # fmt: skip
    """Attention of ``q (B, T, N, H)`` over ``k (B, S, K, H)``, ``v (B, S, K, Hv)``, query ``i``
    seeing key ``j`` when ``j <= i`` (``causal``), ``i - j < window`` (a window) and, with
    segments ``(B, T)`` / ``(B, S)``, of its own document. Returns ``(B, T, N, Hv)`` in
    ``q``'s dtype. ``softcap``, ``scale``: as :func:`~nnxscale.layers.attention.attention`'s.
    ``interpret``: run the kernel's own code in Pallas interpret mode (any backend; slow; for
    tests)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # the TPU kernels: loaded for a TPU only

    B, T, N, H = q.shape
    S = k.shape[1]
    bq, bk = tile(T, block), tile(S, block)
    Tp, Sp = padded(T, bq), padded(S, bk)
    # Padded keys must stay unseen: past every query under a causal mask with no more queries
    # than keys they are; else a segment id of their own (-1, which no real token has) hides
    # them, and padded queries, given the same id, see only them (a finite result, dropped).
    if q_segments is None and Sp > S and not (causal and T <= S):
        q_segments, k_segments = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)
    heads_first = lambda x, n: jnp.swapaxes(pad_tokens(x, n), 1, 2)  # noqa: E731  (B, n, heads, H) -> (B, heads, n, H)
    qh = heads_first(q * jnp.asarray(1.0 / math.sqrt(H) if scale is None else scale, q.dtype), Tp)
    kh, vh = heads_first(k, Sp), heads_first(v, Sp)
    kernel = splash.make_splash_mha_single_device(
        splash.MultiHeadMask([_mask(splash, (Tp, Sp), causal, window) for _ in range(N)]),
        block_sizes=splash.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                                      block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk),
        attn_logits_soft_cap=softcap, interpret=interpret,
    )  # fmt: skip
    if q_segments is None:
        out = jax.vmap(kernel)(qh, kh, vh)
    else:
        ids = splash.SegmentIds(
            q=pad_tokens(jnp.asarray(q_segments, jnp.int32), Tp, fill=-1),
            kv=pad_tokens(jnp.asarray(k_segments, jnp.int32), Sp, fill=-1),
        )
        out = jax.vmap(kernel)(qh, kh, vh, ids)
    return jnp.swapaxes(out, 1, 2)[:, :T].astype(q.dtype)


def _mask(splash, shape: tuple[int, int], causal: bool, window: Optional[int]):
    """One head's static mask: causal, full, or a window ``i - j < window`` (``LocalMask``'s
    ``(window - 1, 0)`` is causal local attention; without the causal mask nothing limits
    the right, ``None``)."""
    if window is None:
        return splash.CausalMask(shape) if causal else splash.FullMask(shape)
    return splash.LocalMask(shape, window_size=(window - 1, 0 if causal else None), offset=0)
