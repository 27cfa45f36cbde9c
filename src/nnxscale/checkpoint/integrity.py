"""Checksums of array data that are the same on any mesh and any number of processes.

A checkpoint records one checksum per array as it is saved and compares it with the
arrays it restores, so damaged data files are found instead of training on garbage (a few
flipped bytes in an Orbax data file otherwise restore without any error).

The checksum of an array is 64 bits: two sums, modulo 2^32, over every word ``i`` of its
data (its position in the flattened global array of 32-bit words, whatever the layout;
64-bit elements and PRNG keys are two words each, 8- and 16-bit elements one each) of

    a_i = mix(w_i ^ m_i)        b_i = w_i * (m_i | 1)

where ``w_i`` is the word, ``mix`` the murmur3 finalizer (a bijection of uint32) and
``m_i`` a per-position constant: ``i * 0x9E3779B9 + 0x7F4A7C15`` (:data:`ALGORITHM`, v2)
or ``mix(i + 0x9E3779B9)`` (v1, still verified when an old checkpoint is restored). For a
fixed position both terms are bijections of ``w_i``, so a change to any single word always
changes both sums; ``a`` is nonlinear, so unrelated changes do not cancel in a
predictable way.

Sums commute, so every device sums the words of its own shard, where the shard lives
(``jax.shard_map``): the devices that hold copies of the same shard split its chunks
between them. The checksum programs have **no collectives**: each returns one row of
partial sums per device, each process adds the rows of its own devices on the host
(:func:`local_sums`), and the processes' sums are added up outside the devices: in files,
one per process, when a checkpoint is saved, and through JAX's coordination service
(:func:`global_sums`) when one is restored. So they can be in flight beside a training
step, which matters: on XLA:CPU two independent programs with cross-process collectives
can start in different orders on different devices and wait for each other forever (see
the multi-process docs). A state saved on ``data=8`` by 2 processes verifies after
restoring onto ``data=2,model=4`` in 1.

Each device walks its shard in chunks of about :data:`CHUNK` words (whole rows of its
trailing dimension), so a checksum needs a few chunks of memory, never a copy of the state.
Arrays whose shards are at most :data:`HOST_BYTES` are summed on the host instead, from the
shards this process holds (each shard once: the copy with replica id 0): the same sums,
with no program to compile for the many small arrays of a state (biases, norms, the step,
the RNG key), which a small model's first save otherwise spent seconds compiling.
Measured (gpt2 train state, 1.49 GB, ``fsdp=8``, 8 CPU devices on 2 cores): 0.4-0.7 s for
v2, 1.3-2.2 s for v1, whose positions needed integer divisions per element.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from nnxscale.jobs import jax_private
from nnxscale.sharding.axes import entry_axes

#: Names the checksum above; stored with the checksums so a future change is recognized.
ALGORITHM = "nnxscale-sum64-v2"
#: The first algorithm (checkpoints saved before v2): still verified on restore.
ALGORITHM_V1 = "nnxscale-sum64-v1"
ALGORITHMS = (ALGORITHM, ALGORITHM_V1)

#: Words per loop step on each device (4 MiB).
CHUNK = 1 << 20
#: Arrays whose shards are at most this many bytes are summed on the host (v2 only).
HOST_BYTES = 1 << 20

_K = np.uint32(0x9E3779B9)  # golden-ratio constant: positions 0, 1, ... get unrelated m_i
_K2 = np.uint32(0x7F4A7C15)


def _mix(h):
    """murmur3's 32-bit finalizer: every input bit affects every output bit."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x) -> jax.Array:
    """The bits of ``x`` as uint32, one word per element (a trailing 2 for 64-bit dtypes and keys)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size in (4, 8):
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16).astype(jnp.uint32)
    raise TypeError(f"no checksum for dtype {x.dtype} ({size} bytes per element)")


def _host_words(a: np.ndarray) -> np.ndarray:
    """:func:`_words` on the host: the same words, for a numpy shard."""
    if a.dtype == np.bool_:
        return a.astype(np.uint32)
    size = a.dtype.itemsize
    a = np.ascontiguousarray(a)
    if size == 4:
        return a.view(np.uint32)
    if size == 8:
        return a.view(np.uint32).reshape(a.shape + (2,))
    if size in (1, 2):
        return a.view(np.uint8 if size == 1 else np.uint16).astype(np.uint32)
    raise TypeError(f"no checksum for dtype {a.dtype} ({size} bytes per element)")


def _host_sums_v2(words: np.ndarray, offsets: Sequence[int], global_shape: tuple) -> np.ndarray:
    """uint32 (2,): the v2 sums of one shard's words, whose first element sits at ``offsets``
    of an array of ``global_shape`` (as :func:`_sums_v2`; numpy's uint32 wraps like XLA's)."""
    gshape = tuple(global_shape) or (1,)
    offsets = tuple(offsets) or (0,)
    words = words.reshape(words.shape or (1,))
    position = np.zeros((1,) * len(gshape), np.uint32)
    for d, stride in enumerate(_row_major_strides(gshape)):
        n = words.shape[d]
        index = (np.arange(offsets[d], offsets[d] + n, dtype=np.uint64) * np.uint64(stride % 2**32)) % 2**32
        position = position + index.astype(np.uint32).reshape((1,) * d + (n,) + (1,) * (len(gshape) - d - 1))
    if words.ndim == len(gshape) + 1:  # 64-bit elements and keys: word t of element i is at 2 * i + t
        position = position[..., None] * np.uint32(2) + np.arange(2, dtype=np.uint32)
    m = position * _K + _K2
    a, b = _mix(words ^ m), words * (m | np.uint32(1))
    return np.array([np.sum(a, dtype=np.uint32), np.sum(b, dtype=np.uint32)], np.uint32)


def _on_host(x: jax.Array) -> bool:
    """Whether ``x`` is summed on the host: shards of at most HOST_BYTES, one or two words each."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x).shape[-1] == 2 and math.prod(x.sharding.shard_shape(x.shape)) * 8 <= HOST_BYTES
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize <= HOST_BYTES


def _host_partial(x: jax.Array) -> np.ndarray:
    """uint32 (1, 2): the v2 sums of the shards of ``x`` that this process holds, each shard
    counted once over the job (by the device holding its replica 0). Blocks until ``x`` is ready."""
    total = np.zeros(2, np.uint32)
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        data = shard.data
        if jax.dtypes.issubdtype(data.dtype, jax.dtypes.prng_key):
            data = jax.random.key_data(data)
        offsets = [s.start or 0 for s in shard.index]
        total = total + _host_sums_v2(_host_words(np.asarray(data)), offsets, x.shape)
    return total[None]


def _row_major_strides(shape) -> list[int]:
    return [math.prod(shape[d + 1 :]) for d in range(len(shape))]


def _mesh_index(mesh: Mesh, axes: Sequence[str]):
    """Inside ``shard_map``: this device's row-major index over the mesh axes ``axes``."""
    return sum(jax.lax.axis_index(a) * math.prod(mesh.shape[b] for b in axes[i + 1 :]) for i, a in enumerate(axes))


def _copies(mesh: Mesh, spec: tuple) -> tuple[int, jax.Array]:
    """How many devices hold a copy of this device's shard, and which copy it holds."""
    axes = tuple(a for a in mesh.axis_names if not any(a in entry for entry in spec))
    return math.prod(mesh.shape[a] for a in axes), _mesh_index(mesh, axes)


def _divisor(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is at most ``cap``."""
    return next(c for c in range(min(n, cap), 0, -1) if n % c == 0)


def _sums_v2(block, mesh: Mesh, spec: tuple, global_shape: tuple) -> jax.Array:
    """Inside ``shard_map``: uint32 (1, 2), this device's part of the two v2 sums.

    ``spec`` has one entry per dimension (mesh axes or ``()``); ``block`` is the local shard.
    The shard is walked as rows of its trailing dimension (split when longer than a
    chunk), so a word's global position is a row's position plus its column: no
    per-element division.
    """
    lshape = block.shape or (1,)
    gshape = tuple(global_shape) or (1,)
    spec = spec or ((),)
    block = block.reshape(lshape)
    gstrides = [s % 2**32 for s in _row_major_strides(gshape)]  # the last one is 1
    base = jnp.zeros((), jnp.uint32)  # global flat position of the shard's first element
    for d, axes in enumerate(spec):
        if axes:
            base = base + jnp.asarray(_mesh_index(mesh, axes) * lshape[d]).astype(jnp.uint32) * np.uint32(gstrides[d])
    n_copies, copy = _copies(mesh, spec)

    cols = _divisor(lshape[-1], CHUNK)
    lead = lshape[:-1] + (lshape[-1] // cols,)  # a row's index decomposes over these ...
    lead_gstrides = gstrides[:-1] + [cols]  # ... with these global strides
    lead_strides = _row_major_strides(lead)
    rows = math.prod(lead)
    view = block.reshape(rows, cols)  # row-major: a view, no data moves
    chunk = max(1, min(rows, CHUNK // cols))  # rows per loop step
    full, rest = divmod(rows, chunk)

    def add(sums, start, n: int, valid=None):
        start = jnp.asarray(start, jnp.int32)  # also under jax_enable_x64
        r = start + jnp.arange(n, dtype=jnp.int32)
        position = base
        for d in range(len(lead)):
            index = r if len(lead) == 1 else (r // lead_strides[d]) % lead[d]
            position = position + index.astype(jnp.uint32) * np.uint32(lead_gstrides[d])
        position = position[:, None] + jnp.arange(cols, dtype=jnp.uint32)  # (n, cols) element positions
        words = _words(jax.lax.dynamic_slice(view, (start, jnp.int32(0)), (n, cols)))  # (n, cols) or (n, cols, 2)
        if words.ndim == 3:  # 64-bit elements and keys: word t of element i is at 2 * i + t
            position = position[..., None] * np.uint32(2) + jnp.arange(2, dtype=jnp.uint32)
        m = position * _K + _K2
        a, b = _mix(words ^ m), words * (m | np.uint32(1))
        if valid is not None:
            a, b = jnp.where(valid, a, 0), jnp.where(valid, b, 0)
        return sums + jnp.stack([jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)])

    def body(step, sums):  # the copies of this shard take every n_copies-th chunk
        j = step * n_copies + copy
        valid = None if full % n_copies == 0 else j < full
        return add(sums, jnp.minimum(j, full - 1) * chunk, chunk, valid)

    sums = jax.lax.pcast(jnp.zeros(2, jnp.uint32), tuple(mesh.axis_names), to="varying")  # differs per device
    if full:
        sums = jax.lax.fori_loop(0, -(-full // n_copies), body, sums)
    if rest:
        sums = add(sums, full * chunk, rest, copy == 0)
    return sums[None]


def _sums_v1(block, mesh: Mesh, spec: tuple, global_shape: tuple) -> jax.Array:
    """Inside ``shard_map``: uint32 (1, 2), this device's part of the two v1 sums."""
    lshape, lstrides = block.shape, _row_major_strides(block.shape)
    gstrides = [s % 2**32 for s in _row_major_strides(tuple(global_shape))]
    size = math.prod(lshape)
    if size >= 2**31 - CHUNK * mesh.size:
        raise ValueError(f"a shard of {size:,} elements is too large to checksum")
    base = jnp.zeros((), jnp.uint32)
    for d, axes in enumerate(spec):
        base = base + jnp.asarray(_mesh_index(mesh, axes) * lshape[d]).astype(jnp.uint32) * np.uint32(gstrides[d])
    n_copies, copy = _copies(mesh, spec)
    flat = block.reshape(-1)
    chunk = min(CHUNK, size)
    n_chunks = -(-size // chunk)

    def body(step, sums):
        j = step * n_copies + copy
        start = jnp.minimum(j * chunk, size - chunk)  # the last chunk overlaps the one before
        words = _words(jax.lax.dynamic_slice(flat, (start,), (chunk,)))
        k = start + jnp.arange(chunk, dtype=jnp.int32)
        valid = (k >= j * chunk) & (j < n_chunks)
        position = base
        for d in range(len(lshape)):
            position = position + ((k // lstrides[d]) % lshape[d]).astype(jnp.uint32) * np.uint32(gstrides[d])
        if words.ndim == 2:
            position = position[:, None] * np.uint32(2) + jnp.arange(2, dtype=jnp.uint32)
            valid = valid[:, None]
        m = _mix(position + _K)
        a = jnp.sum(jnp.where(valid, _mix(words ^ m), 0), dtype=jnp.uint32)
        b = jnp.sum(jnp.where(valid, words * (m | np.uint32(1)), 0), dtype=jnp.uint32)
        return sums + jnp.stack([a, b])

    zero = jax.lax.pcast(jnp.zeros(2, jnp.uint32), tuple(mesh.axis_names), to="varying")
    return jax.lax.fori_loop(0, -(-n_chunks // n_copies), body, zero)[None]


_KERNELS = {ALGORITHM: _sums_v2, ALGORITHM_V1: _sums_v1}


def _spec_entries(spec: P, ndim: int) -> tuple:
    """``P("data", None)`` -> ``(("data",), ())``: the mesh axes of each dimension."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(entry_axes(e) for e in entries)


@functools.lru_cache(maxsize=256)
def _program(shape: tuple, dtype, sharding: NamedSharding, algorithm: str):
    """The jitted per-device partial sums of one kind of array: ``x -> (devices, 2)``.

    One program per shape, dtype and sharding (gpt2's 448 state arrays have 11 kinds); no
    collective: each device writes its own row.
    """
    spec = _spec_entries(sharding.spec, len(shape))
    sums = functools.partial(_KERNELS[algorithm], mesh=sharding.mesh, spec=spec, global_shape=shape)
    every_device = P(sharding.mesh.axis_names)  # (devices, 2): one row of partial sums per device
    return jax.jit(jax.shard_map(sums, mesh=sharding.mesh, in_specs=P(*spec), out_specs=every_device))


def _named(x) -> jax.Array:
    """``x`` as a jax.Array with a NamedSharding (a one-device mesh for a single-device array)."""
    if not isinstance(x, jax.Array):
        x = jnp.asarray(x)
    if isinstance(x.sharding, NamedSharding):
        return x
    if isinstance(x.sharding, SingleDeviceSharding):
        (device,) = x.sharding.device_set
        return jax.device_put(x, NamedSharding(Mesh(np.array([device]), ("device",)), P()))
    raise TypeError(f"no checksum for an array with a {type(x.sharding).__name__}: use a NamedSharding")


def partial_sums(leaves, algorithm: str = ALGORITHM) -> list[jax.Array]:
    """Start the checksums of ``leaves``: one ``(devices, 2)`` uint32 array each, not awaited.

    The programs hold no collective, so they may be in flight beside anything else; the
    caller may donate ``leaves`` right away (JAX orders the reads before the reuse). Small
    arrays (see :data:`HOST_BYTES`) are summed on the host before this returns: their entry
    is already this process's ``(1, 2)`` numpy sum.
    """
    if algorithm not in _KERNELS:
        raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(_KERNELS)})")
    leaves = [_named(x) for x in leaves]
    return [
        _host_partial(x) if algorithm == ALGORITHM and _on_host(x) else _program(x.shape, x.dtype, x.sharding, algorithm)(x)
        for x in leaves
    ]


def local_sums(partials: Sequence[jax.Array | np.ndarray]) -> np.ndarray:
    """``(n, 2)`` uint32: the partial sums of this process's devices, added up. Blocks."""
    rows = jax.device_get([[p] if isinstance(p, np.ndarray) else [s.data for s in p.addressable_shards] for p in partials])
    out = np.zeros((len(rows), 2), np.uint32)
    for i, r in enumerate(rows):
        out[i] = np.sum(np.concatenate(r, axis=0), axis=0, dtype=np.uint32)
    return out


def add(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The sum, modulo 2^32, of several processes' ``(n, 2)`` sums."""
    return np.sum(np.stack(parts), axis=0, dtype=np.uint32)


def to_hex(sums: np.ndarray) -> list[str]:
    """``(n, 2)`` uint32 -> one 16-hex-digit string per row."""
    return [f"{int(a):08x}{int(b):08x}" for a, b in np.asarray(sums, np.uint32)]


def from_hex(texts: Sequence[str]) -> np.ndarray:
    """One 16-hex-digit string per array -> ``(n, 2)`` uint32."""
    return np.array([(int(t[:8], 16), int(t[8:], 16)) for t in texts], np.uint32).reshape(-1, 2)


_exchanges = itertools.count()
EXCHANGE_TIMEOUT_S = 600


def global_sums(local: np.ndarray) -> np.ndarray:
    """Add up every process's :func:`local_sums` through JAX's coordination service.

    Every process of the job calls this the same number of times (as it does
    ``Checkpointer.restore``); in a single process it returns ``local``. No device
    collective is involved, so nothing else in flight on the devices can interleave with it.
    """
    if jax.process_count() == 1:
        return local

    client = jax_private.distributed_client()
    prefix = f"nnxscale/checksums/{next(_exchanges)}"
    client.key_value_set(f"{prefix}/{jax.process_index()}", ",".join(to_hex(local)))
    parts = []
    for i in range(jax.process_count()):
        try:
            text = client.blocking_key_value_get(f"{prefix}/{i}", EXCHANGE_TIMEOUT_S * 1000)
        except Exception as e:
            raise RuntimeError(
                f"process {i} did not report its checksums within {EXCHANGE_TIMEOUT_S} s ({e})"
            ) from None
        parts.append(from_hex(text.split(",")) if text else np.zeros((0, 2), np.uint32))
    return add(parts)


def checksums(leaves, algorithm: str = ALGORITHM) -> list[str]:
    """One 16-hex-digit checksum per array in ``leaves``; every process gets the same values.

    Computed on the devices that hold each array (small ones on the host), added up on the hosts. Blocks.
    """
    return to_hex(global_sums(local_sums(partial_sums(leaves, algorithm))))
