"""shard_map for real: data parallel apply and Megatron tensor-parallel layers.

Everything here runs ``jax.shard_map``: the function body sees one device's shard and
every cross-device step is a collective written out by hand, so a reader (or
``jax.make_jaxpr``) can count them.

- :func:`data_parallel_apply` splits the batch over a mesh axis and replicates the
  parameters; no collective in the forward pass.
- :class:`ColumnParallelLinear` holds kernel columns ``(in, out/n)`` per device and
  returns its output slice; an ``all_gather`` only with ``gather_output=True``.
- :class:`RowParallelLinear` holds kernel rows ``(in/n, out)`` per device, takes its input
  split along features and ``psum``\\ s the partial products: one all-reduce.
- :class:`TensorParallelMLP` is column (GELU) then row: one ``psum`` per forward.

``n`` is the size of the tensor-parallel mesh axis. The shard_maps are manual only over
the axes they name (``axis_names=``); the other mesh axes stay automatic, so on a
``data=2,model=4`` mesh a batch split over ``data`` stays split through the TP layers,
and a TP module can run inside ``data_parallel_apply(module, x, mesh, "data")``.

Parameters are created by a jitted initializer with ``out_shardings``: each device
generates only its own slice, the full kernel never exists on one device. For the same
``rngs`` a layer's (gathered) weights equal those of ``nnx.Linear(in, out, rngs=...)``.
"""

from __future__ import annotations

import functools
import math
from typing import Union

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.errors import LayoutError
from nnxscale.sharding.mesh import context_mesh

AxisName = Union[str, tuple[str, ...]]

_default_kernel_init = nnx.initializers.lecun_normal()  # nnx.Linear's defaults
_default_bias_init = nnx.initializers.zeros_init()


# -- axis helpers ----------------------------------------------------------------------


def _axis_names(mesh: Mesh, axis: AxisName, who: str) -> tuple[str, ...]:
    """Normalize ``axis`` (a name or tuple of names) and check it against ``mesh``."""
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    if not names:
        raise LayoutError(f"{who}: axis is empty; name a mesh axis, one of {tuple(mesh.axis_names)}")
    for name in names:
        if name not in mesh.shape:
            raise LayoutError(
                f"{who}: axis {name!r} is not an axis of the mesh, which has axes {tuple(mesh.axis_names)}"
            )
    if len(set(names)) != len(names):
        raise LayoutError(f"{who}: axis {names} names a mesh axis twice")
    return names


def _spec_entry(names: tuple[str, ...]) -> AxisName:
    """PartitionSpec entry for ``names``: a single axis as a plain string, as JAX prints it."""
    return names[0] if len(names) == 1 else names


def _axis_size(mesh: Mesh, names: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[n] for n in names)


def _describe(mesh: Mesh, names: tuple[str, ...]) -> str:
    return ",".join(f"{n}={mesh.shape[n]}" for n in names)


def _check_divisible(who: str, what: str, size: int, mesh: Mesh, names: tuple[str, ...]) -> None:
    n = _axis_size(mesh, names)
    if size % n:
        raise LayoutError(
            f"{who}: {what}={size} is not divisible by the {n} shards of mesh axis {_describe(mesh, names)}; "
            f"choose {what} as a multiple of {n}"
        )


def _check_features(who: str, x, in_features: int) -> None:
    if x.ndim < 1 or x.shape[-1] != in_features:
        raise LayoutError(f"{who}: input of shape {tuple(x.shape)} has no last dimension of size in_features={in_features}")


def _layer_mesh(layer: nnx.Module, who: str):
    """The mesh a layer's kernel lives on *now*, checked against the layer's axis.

    A layer keeps the mesh it was built on (``layer.mesh``), but ``nnxscale.reshard`` may
    have moved its parameters since; computing on the old mesh would silently move them
    back. Eagerly the kernel's own sharding says where it is; under ``jax.jit`` its
    abstract sharding does.
    """
    value = layer.kernel.get_value()
    if isinstance(value, jax.core.Tracer):
        sharding = jax.typeof(value).sharding
    else:
        sharding = getattr(value, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not isinstance(sharding, NamedSharding):
        mesh = layer.mesh
    for name in layer.axis:
        if name not in mesh.shape:
            raise LayoutError(
                f"{who}: its parameters are on a mesh with axes {tuple(mesh.axis_names)}, which lacks its axis "
                f"{name!r}: reshard it onto a mesh that has {name!r}"
            )
    return mesh


def _cached(builder, *key):
    """``builder(*key)`` from its lru_cache; built uncached when a key is unhashable."""
    try:
        return builder(*key)
    except TypeError:
        return builder.__wrapped__(*key)


# -- sharded parameter creation --------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _initializer(init, shape: tuple[int, ...], dtype, sharding: NamedSharding):
    """``key -> init(key, shape, dtype)``, jitted to produce ``sharding`` (compiled once per layout)."""
    return jax.jit(functools.partial(init, shape=shape, dtype=dtype), out_shardings=sharding)


def _sharded_param(init, key, shape, dtype, mesh: Mesh, spec: P) -> nnx.Param:
    """Create ``init(key, shape, dtype)`` directly in the layout ``spec`` on ``mesh``.

    The initializer runs under ``jax.jit`` with ``out_shardings``: on a mesh with Auto axes
    XLA partitions the random generation, so each device computes only its own slice
    (see ``nnxscale.sharding.mesh`` for the measurement). The Param carries ``out_sharding`` metadata
    so ``nnx.get_partition_spec`` and nnxscale's sharding tools report the layout;
    ``eager_sharding=False`` because the value is already placed.
    """
    create = _cached(_initializer, init, tuple(shape), dtype, NamedSharding(mesh, spec))
    names = tuple(spec) + (None,) * (len(shape) - len(spec))  # one entry per dimension
    return nnx.Param(create(key), out_sharding=names, mesh=mesh, eager_sharding=False)


# -- per-device bodies -----------------------------------------------------------------


def _matmul(x, kernel):
    """``x (..., k) @ kernel (k, m) -> (..., m)``, contracting as ``nnx.Linear`` does."""
    dtype = jnp.promote_types(x.dtype, kernel.dtype)
    x, kernel = x.astype(dtype), kernel.astype(dtype)
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def _column_local(x, kernel, bias=None):
    """One device: ``x (..., in) @ kernel (in, out/n) + bias (out/n,) -> (..., out/n)``."""
    y = _matmul(x, kernel)
    return y if bias is None else y + bias


def _row_local(x, kernel, bias, names):
    """One device: ``x (..., in/n) @ kernel (in/n, out)``, ``psum`` over ``names``, + bias once."""
    y = jax.lax.psum(_matmul(x, kernel), names)  # the all-reduce: partial sums -> (..., out)
    return y if bias is None else y + bias


# -- programs --------------------------------------------------------------------------
#
# Each layer call runs a jitted program built once per configuration, so eager calls do
# not recompile, and a TP program nests inside data_parallel_apply's shard_map. The mesh
# handed to shard_map is resolved at trace time (_context_mesh).


@functools.lru_cache(maxsize=256)
def _data_parallel_program(graphdef, mesh: Mesh, names: tuple[str, ...]):
    """``(state, x (B, ...)) -> module(x)``, batch split over ``names``; no collective."""
    entry = _spec_entry(names)

    def body(state, x_local):  # x_local: (B/n, ...)
        return nnx.merge(graphdef, state)(x_local)

    def apply(state, x):
        return jax.shard_map(
            body, mesh=context_mesh(mesh), in_specs=(P(), P(entry)), out_specs=P(entry), axis_names=frozenset(names)
        )(state, x)

    return jax.jit(apply)


@functools.lru_cache(maxsize=256)
def _column_program(mesh: Mesh, names: tuple[str, ...], gather_output: bool, has_bias: bool):
    """``(x (..., in), kernel, [bias]) -> (..., out)``; one all_gather iff ``gather_output``."""
    entry = _spec_entry(names)

    def body(x, kernel, *bias):  # x: (..., in), kernel: (in, out/n), bias: (out/n,)
        y = _column_local(x, kernel, *bias)  # (..., out/n)
        if gather_output:
            y = jax.lax.all_gather(y, names, axis=y.ndim - 1, tiled=True, to="invarying")  # (..., out)
        return y

    def apply(x, kernel, *bias):
        out_spec = P() if gather_output else P(*(None,) * (x.ndim - 1), entry)
        return jax.shard_map(
            body,
            mesh=context_mesh(mesh),
            in_specs=(P(), P(None, entry)) + (P(entry),) * has_bias,
            out_specs=out_spec,
            axis_names=frozenset(names),
        )(x, kernel, *bias)

    return jax.jit(apply)


@functools.lru_cache(maxsize=256)
def _row_program(mesh: Mesh, names: tuple[str, ...], input_is_parallel: bool, has_bias: bool):
    """``(x (..., in), kernel, [bias]) -> (..., out)``; one psum."""
    entry = _spec_entry(names)

    def body(x, kernel, *bias):  # kernel: (in/n, out), bias: (out,)
        if not input_is_parallel:  # x: (..., in) -> this device's block (..., in/n), no communication
            block = kernel.shape[0]
            start = jax.lax.axis_index(names) * block
            x = jax.lax.dynamic_slice_in_dim(x, start, block, axis=x.ndim - 1)
        return _row_local(x, kernel, bias[0] if bias else None, names)

    def apply(x, kernel, *bias):
        x_spec = P(*(None,) * (x.ndim - 1), entry) if input_is_parallel else P()
        return jax.shard_map(
            body,
            mesh=context_mesh(mesh),
            in_specs=(x_spec, P(entry, None)) + (P(),) * has_bias,
            out_specs=P(),
            axis_names=frozenset(names),
        )(x, kernel, *bias)

    return jax.jit(apply)


@functools.lru_cache(maxsize=256)
def _mlp_program(mesh: Mesh, names: tuple[str, ...]):
    """``(x (..., d), w_up, b_up, w_down, b_down) -> (..., d)``; one psum."""
    entry = _spec_entry(names)

    def body(x, w_up, b_up, w_down, b_down):
        h = jax.nn.gelu(_column_local(x, w_up, b_up))  # (..., d_hidden/n), no communication
        return _row_local(h, w_down, b_down, names)  # psum -> (..., d_model)

    def apply(*args):
        return jax.shard_map(
            body,
            mesh=context_mesh(mesh),
            in_specs=(P(), P(None, entry), P(entry), P(entry, None), P()),
            out_specs=P(),
            axis_names=frozenset(names),
        )(*args)

    return jax.jit(apply)


# -- data parallel ---------------------------------------------------------------------


def data_parallel_apply(module: nnx.Module, x: jax.Array, mesh: Mesh, axis: AxisName = "data"):
    """Apply ``module`` to ``x`` with the batch split over ``axis`` and parameters replicated.

    Args:
      module: any NNX module whose call maps a batch ``(B, ...)`` to outputs whose leading
        dimension is the batch.
      x: ``(B, ...)``, ``B`` divisible by the size of ``axis``.
      mesh: the device mesh.
      axis: a mesh axis name or a tuple of names; the batch is split over their product.

    Returns:
      ``module(x)``: each output ``(B, ...)``, laid out ``P(axis)``; each device holds
      ``(B/n, ...)``, computed from its own rows.

    The module is split with ``nnx.split``; inside ``jax.shard_map`` (in_specs: state
    ``P()``, batch ``P(axis)``; out_specs ``P(axis)``) each device merges it and runs the
    call on its ``B/n`` rows. The forward pass has no collective. State the call changes
    (batch statistics, RNG counters) is not written back: this is a pure apply. Works
    eagerly and under ``jax.jit``; the module may itself hold tensor-parallel layers on
    another axis of the same mesh.
    """
    who = "data_parallel_apply"
    names = _axis_names(mesh, axis, who)
    if getattr(x, "ndim", 0) < 1:
        raise LayoutError(f"{who}: x must have a leading batch dimension, got shape {tuple(getattr(x, 'shape', ()))}")
    n = _axis_size(mesh, names)
    if x.shape[0] % n:
        raise LayoutError(
            f"{who}: batch size {x.shape[0]} is not divisible by the {n} shards of mesh axis "
            f"{_describe(mesh, names)}; pad or trim the batch to a multiple of {n}"
        )
    graphdef, state = nnx.split(module)
    return _cached(_data_parallel_program, graphdef, mesh, names)(state, x)


# -- tensor parallel -------------------------------------------------------------------


class ColumnParallelLinear(nnx.Module):
    """Linear layer with its kernel split by output columns over a mesh axis (Megatron).

    Per device (``n`` = size of ``axis``): kernel ``(in, out/n)`` laid out ``P(None, axis)``,
    bias ``(out/n,)`` laid out ``P(axis)``.

    Call: ``x (..., in)``, replicated over ``axis``. Each device computes its output slice
    ``(..., out/n)`` with no communication. With ``gather_output=False`` (default) the result
    is ``(..., out)`` laid out with its last dimension split over ``axis``, ready for a
    :class:`RowParallelLinear`. With ``gather_output=True`` an ``all_gather`` over ``axis``
    assembles the full ``(..., out)`` on every device.

    Raises :class:`~nnxscale.errors.LayoutError` (a ``ValueError``) when ``out_features`` is not a multiple of ``n`` or ``axis`` is
    not an axis of ``mesh``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        mesh: Mesh,
        axis: AxisName = "model",
        use_bias: bool = True,
        gather_output: bool = False,
        kernel_init=_default_kernel_init,
        bias_init=_default_bias_init,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        who = "ColumnParallelLinear"
        names = _axis_names(mesh, axis, who)
        _check_divisible(who, "out_features", out_features, mesh, names)
        entry = _spec_entry(names)
        # Same key order as nnx.Linear (kernel, then bias), so the weights match it.
        self.kernel = _sharded_param(
            kernel_init, rngs.params(), (in_features, out_features), param_dtype, mesh, P(None, entry)
        )
        if use_bias:
            self.bias = _sharded_param(bias_init, rngs.params(), (out_features,), param_dtype, mesh, P(entry))
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.gather_output = gather_output
        self.mesh = mesh
        self.axis = names

    def __call__(self, x: jax.Array) -> jax.Array:
        """``(..., in) -> (..., out)``; last dim split over ``axis`` unless ``gather_output``."""
        who = "ColumnParallelLinear"
        _check_features(who, x, self.in_features)
        mesh = _layer_mesh(self, who)
        _check_divisible(who, "out_features", self.out_features, mesh, self.axis)
        bias = () if self.bias is None else (self.bias[...],)
        program = _column_program(mesh, self.axis, self.gather_output, bool(bias))
        return program(x, self.kernel[...], *bias)


class RowParallelLinear(nnx.Module):
    """Linear layer with its kernel split by input rows over a mesh axis (Megatron).

    Per device (``n`` = size of ``axis``): kernel ``(in/n, out)`` laid out ``P(axis, None)``;
    bias ``(out,)`` replicated.

    Call: ``x (..., in)``. With ``input_is_parallel=True`` (default) the input's last
    dimension is taken split over ``axis`` (``in_specs P(..., axis)``; free when it already
    is, as the output of a :class:`ColumnParallelLinear` is). With ``False`` the input is
    taken replicated and each device slices its own ``in/n`` block locally (still no
    communication). Each device computes the partial product ``(..., out)`` and one
    ``psum`` over ``axis`` adds them; the bias is added once, after the ``psum``. The result
    ``(..., out)`` is replicated over ``axis``.

    Raises :class:`~nnxscale.errors.LayoutError` (a ``ValueError``) when ``in_features`` is not a multiple of ``n`` or ``axis`` is
    not an axis of ``mesh``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        mesh: Mesh,
        axis: AxisName = "model",
        use_bias: bool = True,
        input_is_parallel: bool = True,
        kernel_init=_default_kernel_init,
        bias_init=_default_bias_init,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        who = "RowParallelLinear"
        names = _axis_names(mesh, axis, who)
        _check_divisible(who, "in_features", in_features, mesh, names)
        entry = _spec_entry(names)
        self.kernel = _sharded_param(
            kernel_init, rngs.params(), (in_features, out_features), param_dtype, mesh, P(entry, None)
        )
        if use_bias:
            self.bias = _sharded_param(bias_init, rngs.params(), (out_features,), param_dtype, mesh, P())
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.input_is_parallel = input_is_parallel
        self.mesh = mesh
        self.axis = names

    def __call__(self, x: jax.Array) -> jax.Array:
        """``(..., in) -> (..., out)``, replicated over ``axis``; one ``psum``."""
        who = "RowParallelLinear"
        _check_features(who, x, self.in_features)
        mesh = _layer_mesh(self, who)
        _check_divisible(who, "in_features", self.in_features, mesh, self.axis)
        bias = () if self.bias is None else (self.bias[...],)
        program = _row_program(mesh, self.axis, self.input_is_parallel, bool(bias))
        return program(x, self.kernel[...], *bias)


class TensorParallelMLP(nnx.Module):
    """The Megatron MLP: ``ColumnParallelLinear`` + GELU, then ``RowParallelLinear``.

    Per device (``n`` = size of ``axis``): ``up.kernel (d_model, d_hidden/n)``,
    ``up.bias (d_hidden/n,)``, ``down.kernel (d_hidden/n, d_model)``, ``down.bias (d_model,)``
    replicated.

    Call: ``x (..., d_model)`` replicated over ``axis`` -> ``(..., d_model)`` replicated.
    One ``jax.shard_map``: each device computes its hidden slice ``(..., d_hidden/n)``
    and its partial output with no communication; a single ``psum`` over ``axis`` adds
    the partial outputs. GELU is ``jax.nn.gelu`` (tanh approximation, as in GPT-2);
    being elementwise it applies to each hidden slice independently. ``up`` and ``down``
    are ordinary layers and may also be called on their own.
    """

    def __init__(self, d_model: int, d_hidden: int, *, mesh: Mesh, axis: AxisName = "model", rngs: nnx.Rngs):
        who = "TensorParallelMLP"
        _check_divisible(who, "d_hidden", d_hidden, mesh, _axis_names(mesh, axis, who))
        self.up = ColumnParallelLinear(d_model, d_hidden, mesh=mesh, axis=axis, rngs=rngs)
        self.down = RowParallelLinear(d_hidden, d_model, mesh=mesh, axis=axis, input_is_parallel=True, rngs=rngs)
        self.mesh = mesh
        self.axis = self.up.axis

    def __call__(self, x: jax.Array) -> jax.Array:
        """``(..., d_model) -> (..., d_model)``; one ``psum``."""
        who = "TensorParallelMLP"
        _check_features(who, x, self.up.in_features)
        mesh = _layer_mesh(self.up, who)
        _check_divisible(who, "d_hidden", self.up.out_features, mesh, self.axis)
        program = _mlp_program(mesh, self.axis)
        return program(x, self.up.kernel[...], self.up.bias[...], self.down.kernel[...], self.down.bias[...])
