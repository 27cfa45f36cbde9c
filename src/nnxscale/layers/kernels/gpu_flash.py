"""NVIDIA: a Pallas GPU flash attention kernel (FlashAttention-2, compiled through Triton), in
nnxscale's layout.

The kernel is JAX's own (``jax.experimental.pallas.ops.gpu.attention.mha``) where the
installed jax ships it, up to 0.12.0, and nnxscale's (:mod:`.triton_flash`) from 0.12.1, which
ships none. Both walk key/value tiles with an online softmax and keep the log-sum-exp, their
backward recomputing the tiles from it; both take one document id per token for queries and
keys alike (self-attention: ``T == S``) and as many key/value heads as query heads, so
grouped-query keys and values are repeated per query head here (their gradients summed back by
the repeat's own gradient). nnxscale uses it on NVIDIA GPUs where cuDNN's fused attention does
not apply here: document masks, float32, logit soft-capping.

The switches of :func:`~nnxscale.layers.attention.attention`: JAX's kernel takes a scale
(``sm_scale``) but neither a sliding window nor a soft cap, so with either of them nnxscale's
kernel runs (it skips the key tiles outside the window and masks inside the tiles at its
edge). Neither kernel takes values of another width than the keys (their tiles are one
width): :func:`~nnxscale.layers.attention.resolve` leaves this kernel out for them.
"""

from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp

from nnxscale.layers.kernels import pad_tokens, padded, triton_flash

#: Tokens per forward tile of queries and of keys (the kernel's defaults), fewer for a shorter sequence.
BLOCK = 128
#: Tokens per tile of the backward kernels (the kernel's defaults).
BACKWARD_BLOCK = 32


def forward_tile(head_width: int) -> int:
    """Tokens per forward tile for heads ``head_width`` wide: :data:`BLOCK` up to 128 wide,
    then fewer, a power of two, so that the tiles fit a GPU's shared memory. Triton keeps a
    query tile and two stages of key and value tiles there, about 10 x tile x width bytes in
    bfloat16: 160 KiB at 128 x 128, within the H100's 227 KiB and the A100's 164 KiB; 128
    tokens of Gemma's 256-wide heads asked 320 KiB, and the H100 compiler refused the step."""
    if head_width <= 128:
        return BLOCK
    return max(BACKWARD_BLOCK, 1 << ((BLOCK * 128 // head_width).bit_length() - 1))


def applies(T: int, S: int) -> bool:
    """Whether the kernel takes this attention: self-attention (one array of document ids
    serves queries and keys)."""
    return T == S


def gpu_flash_attention(q, k, v, q_segments=None, k_segments=None, *, causal: bool = True,
                        block: Optional[int] = None, interpret: bool = False, own: bool = False,
                        window: Optional[int] = None, softcap: Optional[float] = None,
                        scale: Optional[float] = None):  # fmt: skip
    """Attention of ``q (B, T, N, H)`` over ``k, v (B, S, K, H)``, query ``i`` seeing key ``j``
    when ``j <= i`` (``causal``), ``i - j < window`` (a window) and, with segments ``(B, T)``
    (``k_segments`` the same array: self-attention), of its own document. Returns
    ``(B, T, N, H)`` in ``q``'s dtype. ``softcap``, ``scale``: as
    :func:`~nnxscale.layers.attention.attention`'s. ``interpret``: run the kernel's own code in
    Pallas interpret mode (any backend; for tests). ``own``: nnxscale's kernel even where jax
    ships its own (to compare the two)."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if not applies(T, S):
        raise ValueError(f"the Pallas GPU kernel takes self-attention only (as many keys as queries), got T={T}, S={S}")
    if v.shape[-1] != H:
        raise ValueError(f"the Pallas GPU kernel takes values as wide as the keys only, got {v.shape[-1]} and {H}")
    # Tiles of a power of two tokens (Triton's), whole backward tiles among them.
    b = min(block or forward_tile(H), max(BACKWARD_BLOCK, 1 << (T - 1).bit_length()))
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
    q, k, v = pad_tokens(q, n), pad_tokens(k, n), pad_tokens(v, n)
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    # JAX's kernel has neither a window nor a cap: nnxscale's takes them.
    shipped = None if own or window is not None or softcap is not None else shipped_kernel()
    if shipped is None:
        out = triton_flash.flash_attention(q, k, v, segments, scale=scale, causal=causal, block=b, backward_block=bb,
                                           interpret=interpret, window=window, softcap=softcap)  # fmt: skip
    else:
        sizes = shipped.BlockSizes(block_q=b, block_k=b, block_q_dkv=bb, block_kv_dkv=bb, block_q_dq=bb, block_kv_dq=bb)
        out = shipped.mha(q, k, v, segments, sm_scale=scale, causal=causal, block_sizes=sizes, interpret=interpret)
    return out[:, :T].astype(q.dtype)


def shipped_kernel():
    """JAX's own Pallas GPU attention module where the installed jax ships it (to 0.12.0),
    else None (imported on first use: it pulls in the Triton backend)."""
    try:
        from jax.experimental.pallas.ops.gpu import attention  # gone from jax 0.12.1
    except ImportError:
        return None
    return attention
