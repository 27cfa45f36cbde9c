"""Checksums of array data that are the same on any mesh and any number of processes.

A checkpoint records one checksum per array as it is saved and compares it with the
arrays it restores, so damaged data files are found instead of training on garbage (a few
flipped bytes in an Orbax data file otherwise restore without any error).

The checksum of an array is 64 bits: two sums, modulo 2^32, over every element ``i`` (its
position in the flattened array, whatever the layout) of

    a_i = mix(w_i ^ m_i)        b_i = w_i * (m_i | 1)        with m_i = mix(i + K)

where ``w_i`` is the element's bits as an unsigned integer and ``mix`` the murmur3
finalizer (a bijection of uint32). For a fixed position both terms are bijections of
``w_i``, so a change to any single element always changes both sums; ``a`` is
nonlinear, so unrelated changes do not cancel in a predictable way. Sums are
commutative, so each device sums its own shard where it lives and XLA adds the partial
sums: a state saved on ``data=8`` verifies after restoring onto ``data=2,model=4`` or onto
another process count. Replicated copies are counted once (XLA reduces the logical array).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: Names the checksum above; stored with the checksums so a future change is recognized.
ALGORITHM = "nnxscale-sum64-v1"

_K = np.uint32(0x9E3779B9)  # golden-ratio constant: positions 0, 1, ... get unrelated m_i


def _mix(h):
    """murmur3's 32-bit finalizer: every input bit affects every output bit."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x) -> jax.Array:
    """The bits of ``x`` as uint32, one word per element (two for 64-bit dtypes)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        unsigned = jnp.uint8 if size == 1 else jnp.uint16
        return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # (..., 2)
    raise TypeError(f"no checksum for dtype {x.dtype} ({size} bytes per element)")


def _checksum(x) -> jax.Array:
    """uint32 (2,): the two sums of one array."""
    w = _words(x)
    position = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(w.ndim)):  # row-major flat index, mod 2^32
        position = position + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * np.uint32(stride % 2**32)
        stride *= w.shape[axis]
    m = _mix(position + _K)
    a = jnp.sum(_mix(w ^ m), dtype=jnp.uint32)
    b = jnp.sum(w * (m | np.uint32(1)), dtype=jnp.uint32)
    return jnp.stack([a, b])


@jax.jit
def _checksums(leaves):
    return [_checksum(x) for x in leaves]


def checksums(leaves) -> list[str]:
    """One 16-hex-digit checksum per array in ``leaves`` (a list of ``jax.Array``).

    Computed on the devices that hold each array (one jitted program for the whole list);
    every process gets the same values. Blocks until they are on the host.
    """
    if not leaves:
        return []
    sums = jax.device_get(_checksums(list(leaves)))
    return [f"{int(a):08x}{int(b):08x}" for a, b in sums]
