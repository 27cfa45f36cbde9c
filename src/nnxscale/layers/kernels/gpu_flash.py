"""NVIDIA: the Pallas GPU flash attention kernel shipped in JAX, in nnxscale's layout.

``jax.experimental.pallas.ops.gpu.attention.mha`` is FlashAttention-2 written in Pallas and
compiled through Triton: the forward walks key/value tiles with an online softmax and keeps
the log-sum-exp, the backward (its own kernels) recomputes the tiles from it. It takes one
document id per token for queries and keys alike (self-attention: ``T == S``) and as many
key/value heads as query heads, so grouped-query keys and values are repeated per query head
here (their gradients summed back by the repeat's own gradient). nnxscale uses it on NVIDIA
GPUs where cuDNN's fused attention does not apply here: document masks, float32.
"""

from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp

from nnxscale.layers.kernels import pad_tokens, padded

#: Tokens per forward tile of queries and of keys (the kernel's defaults), fewer for a shorter sequence.
BLOCK = 128
#: Tokens per tile of the backward kernels (the kernel's defaults).
BACKWARD_BLOCK = 32


def applies(T: int, S: int) -> bool:
    """Whether the kernel takes this attention: self-attention (one array of document ids
    serves queries and keys)."""
    return T == S


def gpu_flash_attention(q, k, v, q_segments=None, k_segments=None, *, causal: bool = True,
                        block: Optional[int] = None, interpret: bool = False):  # fmt: skip
    """Attention of ``q (B, T, N, H)`` over ``k, v (B, S, K, H)``, query ``i`` seeing key ``j``
    when ``j <= i`` (``causal``) and, with segments ``(B, T)`` (``k_segments`` the same
    array: self-attention), of its own document. Returns ``(B, T, N, H)`` in ``q``'s dtype.
    ``interpret``: run the kernel's own code in Pallas interpret mode (any backend; for tests)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if not applies(T, S):
        raise ValueError(f"the Pallas GPU kernel takes self-attention only (as many keys as queries), got T={T}, S={S}")
    b = min(block or BLOCK, padded(T, BACKWARD_BLOCK))  # whole backward tiles too
    n = padded(T, b)
    # Padded keys stay unseen: past every query under a causal mask, else by a document id of
    # their own (-1, which no real token has); padded queries see only them and are dropped.
    segments = q_segments
    if segments is None and n > T and not causal:
        segments = jnp.zeros((B, T), jnp.int32)
    if N != K:  # grouped-query: query head n reads key/value head n // (N / K)
        k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    if segments is not None:
        segments = pad_tokens(jnp.asarray(segments, jnp.int32), n, fill=-1)
    bb = min(BACKWARD_BLOCK, b)
    out = pallas_gpu.mha(
        pad_tokens(q, n), pad_tokens(k, n), pad_tokens(v, n), segments, sm_scale=1.0 / math.sqrt(H), causal=causal,
        block_sizes=pallas_gpu.BlockSizes(block_q=b, block_k=b, block_q_dkv=bb, block_kv_dkv=bb, block_q_dq=bb,
                                          block_kv_dq=bb),
        interpret=interpret,
    )  # fmt: skip
    return out[:, :T].astype(q.dtype)
