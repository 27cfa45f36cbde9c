"""Four single-device simulations of sharding, each standing in for a real multi-device API.

These run on one device and compute what the real thing would produce, so the idea can be
learned (and checked) without a mesh. ``tests/test_simulate.py`` checks each one against
the real API on an 8-device CPU mesh.

1. :func:`mesh_init_simulate` -- *init under a mesh*. Production creates parameters
   directly in their sharded layout (``jax.jit(create, out_shardings=...)`` under
   ``jax.set_mesh(mesh)``; in nnxscale, :func:`nnxscale.sharded_init`). The build line
   ``nnx.Linear(in, features, rngs=nnx.Rngs(seed))`` is the same; only where the arrays
   live differs, so the module's state has the same leaves (2 for a Linear).
2. :func:`state_to_sharded_layout` -- *a sharding tree parallel to the state*.
   ``nnx.split`` gives the state pytree; ``jax.tree_util.tree_map`` over it gives a tree of
   ``PartitionSpec`` of the same structure, which ``NamedSharding``/``jax.device_put``/
   ``out_shardings`` consume leaf by leaf.
3. :func:`partition_spec_layout` -- *what one device holds*. The shard shape of a
   ``(in, out)`` kernel under ``P(None, "model")``, the figure
   ``NamedSharding(mesh, spec).shard_shape(shape)`` reports on a real mesh.
4. :func:`shard_map_simulate` -- *``jax.shard_map`` data parallelism*. A Python loop over
   batch chunks with one replicated model, concatenated along the batch: what
   ``jax.shard_map(f, in_specs=(P(), P("data")), out_specs=P("data"))`` computes, the
   loop standing for devices that run at once (:func:`nnxscale.data_parallel_apply`).

Conventions (the exercises these come from fix them): every scalar argument arrives as a
float and is cast with ``int()``; every result is a 1-D float ``jax.numpy`` array. Where
the exercises assume even division, an uneven input raises ``ValueError`` instead of
silently dropping rows or columns; so do non-positive counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnxscale.sharding.layout import LayoutError, shard_shape


def _positive(name: str, value: float) -> int:
    n = int(value)
    if n <= 0:
        raise ValueError(f"{name} must be a positive count, got {value!r}")
    return n


def _in_dim(who: str, x) -> int:
    if jnp.ndim(x) < 1:
        raise ValueError(f"{who}: x must be (N, in_dim), got a scalar")
    return int(jnp.shape(x)[-1])


def _linear(seed: int, in_dim: int, features: int) -> nnx.Linear:
    """The build line production code runs under a mesh."""
    return nnx.Linear(in_dim, features, rngs=nnx.Rngs(seed))


def _pick_spec(leaf) -> P:
    """2-D kernel ``(in, out)`` -> ``P(None, "model")``; 1-D bias ``(out,)`` -> ``P("model")``."""
    return P(None, "model") if leaf.ndim == 2 else P("model")


def mesh_init_simulate(seed: float, x: jax.Array, features: float, mesh_axes: float) -> jax.Array:
    """``[features, mesh_axes, n_leaves]``, shape ``(3,)``.

    Builds ``nnx.Linear(x.shape[-1], features, rngs=nnx.Rngs(seed))`` (what production
    builds under a ``mesh_axes``-device mesh) and counts the leaves of its ``nnx.split``
    state: 2 for a Linear (kernel, bias).
    """
    seed = int(seed)
    features = _positive("features", features)
    mesh_axes = _positive("mesh_axes", mesh_axes)
    model = _linear(seed, _in_dim("mesh_init_simulate", x), features)
    _, state = nnx.split(model)
    n_leaves = len(jax.tree_util.tree_leaves(state))
    return jnp.array([float(features), float(mesh_axes), float(n_leaves)])


def spec_tree(state):
    """The PartitionSpec tree parallel to a Linear's state (kernel ``P(None, "model")``, bias ``P("model")``)."""
    return jax.tree_util.tree_map(_pick_spec, state)


def state_to_sharded_layout(seed: float, x: jax.Array, features: float) -> jax.Array:
    """``[number of PartitionSpecs in the sharding tree]``, shape ``(1,)``: ``[2.0]`` for a Linear.

    Splits ``nnx.Linear(x.shape[-1], features, rngs=nnx.Rngs(seed))`` and maps its state to
    a parallel tree of PartitionSpecs with ``jax.tree_util.tree_map``. The count treats each
    spec as one leaf (``is_leaf``), whatever JAX's pytree registration of ``PartitionSpec``.
    """
    features = _positive("features", features)
    model = _linear(int(seed), _in_dim("state_to_sharded_layout", x), features)
    _, state = nnx.split(model)
    specs = spec_tree(state)
    n_leaves = len(jax.tree_util.tree_leaves(specs, is_leaf=lambda v: isinstance(v, P)))
    return jnp.array([float(n_leaves)])


def partition_spec_layout(num_devices: float, kernel_in: float, kernel_out: float) -> jax.Array:
    """``[kernel_in, kernel_out // num_devices]``, shape ``(2,)``.

    The per-device shape of a ``(kernel_in, kernel_out)`` kernel under ``P(None, "model")``
    on a ``model`` axis of ``num_devices``: axis 0 replicated, axis 1 split. Raises
    ``ValueError`` (:class:`nnxscale.LayoutError`) when ``num_devices`` does not divide
    ``kernel_out``.
    """
    num_devices = _positive("num_devices", num_devices)
    kernel_in = _positive("kernel_in", kernel_in)
    kernel_out = _positive("kernel_out", kernel_out)
    try:
        rows, cols = shard_shape((kernel_in, kernel_out), P(None, "model"), mesh={"model": num_devices})
    except LayoutError as e:
        raise LayoutError(
            f"partition_spec_layout: kernel_out={kernel_out} is not divisible by num_devices={num_devices}; "
            f"{kernel_out % num_devices} columns would be dropped ({e})"
        ) from e
    return jnp.array([float(rows), float(cols)])


def shard_map_simulate(seed: float, x: jax.Array, num_shards: float, features: float) -> jax.Array:
    """The data-parallel output, flattened: length ``N * features``.

    One ``nnx.Linear(x.shape[-1], features, rngs=nnx.Rngs(seed))``, built once (its
    parameters are replicated in production), is applied to each of ``num_shards`` row
    chunks ``jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=0)`` with
    ``chunk = N // num_shards``; the outputs ``(chunk, features)`` are concatenated along
    axis 0 to ``(N, features)`` and flattened. Raises ``ValueError`` when ``num_shards``
    does not divide ``N``.
    """
    seed = int(seed)
    num_shards = _positive("num_shards", num_shards)
    features = _positive("features", features)
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"shard_map_simulate: x must be 2-D (N, in_dim), got shape {x.shape}")
    n = x.shape[0]
    if n % num_shards:
        raise ValueError(
            f"shard_map_simulate: N={n} rows are not divisible by num_shards={num_shards}; "
            f"{n % num_shards} rows would be dropped"
        )
    model = _linear(seed, x.shape[-1], features)  # once, outside the loop: replicated params
    chunk = n // num_shards
    outs = []
    for i in range(num_shards):  # on a mesh these run at once, one per device
        x_shard = jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=0)  # (chunk, in_dim)
        outs.append(model(x_shard))  # (chunk, features)
    out = jnp.concatenate(outs, axis=0)  # (N, features)
    return out.reshape(-1)
