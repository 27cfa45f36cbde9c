"""NVIDIA: FlashAttention-2 written in Pallas for the Triton backend, forward and backward.

JAX shipped such a kernel (``jax.experimental.pallas.ops.gpu.attention``) up to 0.12.0 and
:mod:`.gpu_flash` uses it where it exists; from 0.12.1 JAX ships none (it points to the
separate tokamax library, which needs Python 3.12 and a large set of dependencies), so
:mod:`.gpu_flash` runs this one.

The algorithm (Dao, 2023): the forward walks tiles of keys for each tile of queries with an
online softmax and keeps one log-sum-exp per query; the backward recomputes each tile's
probabilities from it, one kernel for the keys' and values' gradients (walking the queries)
and one for the queries' (walking the keys), so nothing of size ``T x S`` is ever stored.
A causal mask skips the tiles wholly above the diagonal, a sliding window those wholly before
it (each loop starts at the first tile the window reaches, and ends at the last); a soft cap
(``softcap * tanh(s / softcap)``, Gemma 2) is applied to the scaled scores before the mask, its
slope recomputed in the backward. Layout: queries, keys and values
``(B, T, N, H)`` with as many key/value heads as query heads, document ids ``(B, T)`` or
none, ``T`` a whole number of tiles (the caller pads); tiles of 16 or more tokens and a
head dimension of 16 or more, each a power of two (Triton's products).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

# A finite "minus infinity": a row whose first tile is all masked then gives exp(0), which the
# first visible key's rescaling (exp(MASKED - m) = 0) erases, where -inf would give NaN.
MASKED = -0.7 * float(np.finfo(np.float32).max)


def _dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """``a @ b`` (either transposed) of two tiles, accumulated in float32."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _scores(q, k, scale, q_pos, k_pos, q_seg, k_seg, causal: bool, window=None, softcap=None):
    """One tile's scaled scores ``(bq, bk)`` in float32, masked ones at ``MASKED``, and under a
    cap the slope of the capped scores against the scaled ones (``1 - tanh^2``; else None)."""
    s = _dot(q, k, trans_b=True) * scale
    slope = None
    if softcap is not None:
        t = jnp.tanh(s / softcap)
        s, slope = t * softcap, 1.0 - t * t
    keep = q_pos[:, None] >= k_pos[None, :] if causal else None
    if window is not None:
        near = q_pos[:, None] - k_pos[None, :] < window
        keep = near if keep is None else keep & near
    if q_seg is not None:
        same = q_seg[:, None] == k_seg[None, :]
        keep = same if keep is None else keep & same
    return (s if keep is None else jnp.where(keep, s, MASKED)), slope


def _tiles_seen(tile, tile_size: int, other_size: int, total: int, causal: bool):
    """How many tiles of ``other_size`` keys query tile ``tile`` sees (all, or up to its end)."""
    if not causal:
        return total
    return jnp.minimum(total, lax.div((tile + 1) * tile_size + other_size - 1, other_size))


def _first_key_tile(tile, tile_size: int, other_size: int, window):
    """The first tile of ``other_size`` keys that query tile ``tile`` sees: 0, or under a
    window the one holding the first query's earliest key (``p - window + 1``)."""
    if window is None:
        return 0
    return lax.div(jnp.maximum(tile * tile_size - window + 1, 0), other_size)


def _forward_kernel(q_ref, k_ref, v_ref, *refs, scale: float, causal: bool, block_k: int, segments: bool, window,
                    softcap):  # fmt: skip
    qs_ref, ks_ref, o_ref, lse_ref = refs if segments else (None, None, *refs)
    block_q = q_ref.shape[0]
    i = pl.program_id(2)
    q = q_ref[...]
    q_pos = i * block_q + jnp.arange(block_q)
    q_seg = qs_ref[...] if segments else None

    def tile(j, carry):
        m, l, acc = carry
        start = pl.multiple_of(j * block_k, block_k)
        keys = pl.ds(start, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        k_seg = ks_ref[keys] if segments else None
        s, _ = _scores(q, k, scale, q_pos, start + jnp.arange(block_k), q_seg, k_seg, causal, window, softcap)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        rescale = jnp.exp(m - m_new)
        return m_new, l * rescale + jnp.sum(p, axis=1), acc * rescale[:, None] + _dot(p.astype(v.dtype), v)

    n = _tiles_seen(i, block_q, block_k, k_ref.shape[0] // block_k, causal)
    init = (jnp.full((block_q,), MASKED, jnp.float32), jnp.zeros((block_q,), jnp.float32),
            jnp.zeros(q_ref.shape, jnp.float32))  # fmt: skip
    m, l, acc = lax.fori_loop(_first_key_tile(i, block_q, block_k, window), n, tile, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, scale: float, causal: bool, block_q: int,
                segments: bool, window, softcap):  # fmt: skip
    qs_ref, ks_ref, dk_ref, dv_ref = refs if segments else (None, None, *refs)
    block_k = k_ref.shape[0]
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    k_pos = j * block_k + jnp.arange(block_k)
    k_seg = ks_ref[...] if segments else None

    def tile(i, carry):
        dk, dv = carry
        start = pl.multiple_of(i * block_q, block_q)
        rows = pl.ds(start, block_q)
        q, do = q_ref[rows, :], do_ref[rows, :]
        q_seg = qs_ref[rows] if segments else None
        s, slope = _scores(q, k, scale, start + jnp.arange(block_q), k_pos, q_seg, k_seg, causal, window, softcap)
        p = jnp.exp(s - lse_ref[rows][:, None])
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (_dot(do, v, trans_b=True) - delta_ref[rows][:, None])
        if slope is not None:
            ds = ds * slope  # through softcap * tanh(s / softcap)
        return dk + _dot(ds.astype(q.dtype), q, trans_a=True), dv

    first = lax.div(j * block_k, block_q) if causal else 0  # tiles of queries wholly before these keys see none
    last = q_ref.shape[0] // block_q
    if window is not None:  # nor those past the window of the last key ((j + 1) * block_k - 1 + window - 1)
        last = jnp.minimum(last, lax.div((j + 1) * block_k + window - 2, block_q) + 1)
    zeros = jnp.zeros(k_ref.shape, jnp.float32)
    dk, dv = lax.fori_loop(first, last, tile, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, scale: float, causal: bool, block_k: int,
               segments: bool, window, softcap):  # fmt: skip
    qs_ref, ks_ref, dq_ref = refs if segments else (None, None, *refs)
    block_q = q_ref.shape[0]
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    q_pos = i * block_q + jnp.arange(block_q)
    q_seg = qs_ref[...] if segments else None
    lse, delta = lse_ref[...], delta_ref[...]

    def tile(j, dq):
        start = pl.multiple_of(j * block_k, block_k)
        keys = pl.ds(start, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        k_seg = ks_ref[keys] if segments else None
        s, slope = _scores(q, k, scale, q_pos, start + jnp.arange(block_k), q_seg, k_seg, causal, window, softcap)
        ds = jnp.exp(s - lse[:, None]) * (_dot(do, v, trans_b=True) - delta[:, None])
        if slope is not None:
            ds = ds * slope
        return dq + _dot(ds.astype(k.dtype), k)

    n = _tiles_seen(i, block_q, block_k, k_ref.shape[0] // block_k, causal)
    dq = lax.fori_loop(_first_key_tile(i, block_q, block_k, window), n, tile, jnp.zeros(q_ref.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _specs(T: int, H: int, block: int, segments: bool):
    """BlockSpecs over the grid (b, n, tile) for the walked tile's arrays and for the whole
    sequence of the arrays a kernel loops over: tokens (B, T, N, H), per-row (B, N, T) and
    document ids (B, T)."""
    tile = pl.BlockSpec((None, block, None, H), lambda b, n, t: (b, t, n, 0))
    whole = pl.BlockSpec((None, T, None, H), lambda b, n, t: (b, 0, n, 0))
    rows_tile = pl.BlockSpec((None, None, block), lambda b, n, t: (b, n, t))
    rows_whole = pl.BlockSpec((None, None, T), lambda b, n, t: (b, n, 0))
    seg_tile = pl.BlockSpec((None, block), lambda b, n, t: (b, t)) if segments else None
    seg_whole = pl.BlockSpec((None, T), lambda b, n, t: (b, 0)) if segments else None
    return tile, whole, rows_tile, rows_whole, seg_tile, seg_whole


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret: bool, name: str):
    from jax.experimental.pallas import triton as plgpu  # the Triton backend: loaded for a GPU kernel only

    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=interpret,
                          name=name)  # fmt: skip


def _forward(q, k, v, segments, scale, causal, block, backward_block, interpret, window, softcap):
    B, T, N, H = q.shape
    has_seg = segments is not None
    tile, whole, rows_tile, _, seg_tile, seg_whole = _specs(T, H, block, has_seg)
    kernel = functools.partial(_forward_kernel, scale=scale, causal=causal, block_k=block, segments=has_seg,
                               window=window, softcap=softcap)  # fmt: skip
    seg = (segments, segments) if has_seg else ()
    o, lse = _call(kernel, (B, N, T // block), [tile, whole, whole, *((seg_tile, seg_whole) if has_seg else ())],
                   [tile, rows_tile], [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, N, T), jnp.float32)],
                   interpret, "nnxscale_flash_forward")(q, k, v, *seg)  # fmt: skip
    return o, (q, k, v, segments, o, lse)


def _backward(scale, causal, block, backward_block, interpret, window, softcap, res, do):
    q, k, v, segments, o, lse = res
    B, T, N, H = q.shape
    has_seg = segments is not None
    b = backward_block
    tile, whole, rows_tile, rows_whole, seg_tile, seg_whole = _specs(T, H, b, has_seg)
    delta = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
    seg = (segments, segments) if has_seg else ()
    switches = dict(scale=scale, causal=causal, segments=has_seg, window=window, softcap=softcap)
    dkv = functools.partial(_dkv_kernel, block_q=b, **switches)
    dk, dv = _call(dkv, (B, N, T // b), [whole, tile, tile, whole, rows_whole, rows_whole,
                                         *((seg_whole, seg_tile) if has_seg else ())],
                   [tile, tile], [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
                   interpret, "nnxscale_flash_dkv")(q, k, v, do, lse, delta, *seg)  # fmt: skip
    dqk = functools.partial(_dq_kernel, block_k=b, **switches)
    dq = _call(dqk, (B, N, T // b), [tile, whole, whole, tile, rows_tile, rows_tile,
                                     *((seg_tile, seg_whole) if has_seg else ())],
               tile, jax.ShapeDtypeStruct(q.shape, q.dtype), interpret, "nnxscale_flash_dq")(q, k, v, do, lse, delta, *seg)  # fmt: skip
    return dq, dk, dv, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10))
def _flash(q, k, v, segments, scale, causal, block, backward_block, interpret, window, softcap):
    return _forward(q, k, v, segments, scale, causal, block, backward_block, interpret, window, softcap)[0]


_flash.defvjp(_forward, _backward)


def flash_attention(q, k, v, segments: Optional[jax.Array] = None, *, scale: float, causal: bool = True,
                    block: int = 128, backward_block: int = 32, interpret: bool = False, window: Optional[int] = None,
                    softcap: Optional[float] = None):  # fmt: skip
    """Attention of ``q`` over ``k, v``, all ``(B, T, N, H)`` with ``T`` a multiple of ``block``
    and of ``backward_block``; query ``i`` sees key ``j`` when ``j <= i`` (``causal``), when
    ``i - j < window`` (a sliding window) and, with ``segments (B, T)``, when both carry the
    same id. ``softcap``: the scaled scores become ``softcap * tanh(scores / softcap)``.
    Returns ``(B, T, N, H)`` in ``q``'s dtype. ``interpret``: Pallas interpret mode (any
    backend; for tests)."""
    T = q.shape[1]
    if T % block or T % backward_block:
        raise ValueError(f"{T} tokens are not whole tiles of {block} and {backward_block}: pad them first")
    window = None if window is None else int(window)
    softcap = None if softcap is None else float(softcap)
    return _flash(q, k, v, segments, float(scale), causal, block, backward_block, interpret, window, softcap)
