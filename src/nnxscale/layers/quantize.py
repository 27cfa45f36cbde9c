"""A frozen weight stored quantized (QLoRA's base): 4-bit NormalFloat or int8 in blocks of 64,
dequantized where the layer reads it.

:class:`Quantized` holds a weight's codes and their scales (both sharded like the weight) in
place of the weight's array, as the value of its ``nnx.Param``. Reading it the way a layer
reads a weight, ``param[...]``, returns the dequantized weight in the compute dtype, so the
layers that read it (``nnx.Linear``, ``nnx.Einsum``, a chunked MLP, a mixture's experts) run
unchanged, and inside a scanned stack only the layer being run is ever dequantized: no
full-precision copy of the base exists on a device.

Blocks (Dettmers et al., 2023, "QLoRA"): each block of ``BLOCK`` consecutive entries along a
weight's last input dimension (the contraction, as in a Hugging Face weight's rows) has its
own absmax scale, kept in float32 (QLoRA's double quantization of the scales, 0.37 bits per
entry more saved, is not done: one float32 per 64 entries is 0.5 bits). A dimension that 64
does not divide (only the test models') takes the largest block that divides it.

The quantization math is Qwix's (``qwix.quantize``/``qwix.dequantize``: Google's JAX
quantization library; its NF4 codebook is the QLoRA paper's, Appendix E). Qwix's own way of
quantizing a model (its providers, which intercept a module's products) is not used: a
scanned stack's weights and their logical sharding names must stay what the model made, and
the weights here are frozen inputs read per layer, not quantized per call.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec as P

from nnxscale.errors import ConfigError
from nnxscale.layers.quantize_names import SCHEMES as NAMES

#: The schemes of ``--quantize-base`` (:data:`~nnxscale.layers.quantize_names.SCHEMES`): the
#: stored code of each weight entry, as Qwix names it.
SCHEMES = dict(zip(NAMES, ("nf4", jnp.int8)))
#: Entries per block (QLoRA's 64).
BLOCK = 64


@struct.dataclass
class Quantized:
    """A weight stored as ``codes`` (its shape; ``uint4`` NF4 codes or ``int8``) and ``scales``
    (its shape, but the block axis divided by the block size; float32), dequantized to ``dtype``
    when read with ``[...]`` (or any index). ``shape``/``dtype`` are the weight's."""

    codes: jax.Array
    scales: jax.Array
    scheme: str = struct.field(pytree_node=False, default="nf4")
    dtype: Any = struct.field(pytree_node=False, default=jnp.float32)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def ndim(self) -> int:
        return len(self.codes.shape)

    @property
    def size(self) -> int:
        return math.prod(self.codes.shape)

    def dequantize(self, dtype=None) -> jax.Array:
        """The weight in ``dtype`` (default ``self.dtype``): codes times their block's scale."""
        import qwix

        q = qwix.QArray(self.codes, self.scales, None, SCHEMES[self.scheme])
        return qwix.dequantize(q).astype(dtype or self.dtype)

    def __getitem__(self, index) -> jax.Array:
        w = self.dequantize()
        return w if index is Ellipsis else w[index]

    def astype(self, dtype) -> jax.Array:
        return self.dequantize(dtype)


nnx.register_data_type(Quantized)


def is_quantized(x) -> bool:
    return isinstance(x, Quantized)


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ConfigError(f"--quantize-base {scheme!r}: choose one of {', '.join(SCHEMES)}")
    return scheme


def block_size(dim: int) -> int:
    """The block along a dimension of ``dim`` entries: ``BLOCK``, or the largest divisor below it."""
    return math.gcd(dim, BLOCK)


def quantize(w: jax.Array, scheme: str, axis: int, dtype=jnp.float32) -> Quantized:
    """``w`` quantized in blocks along ``axis`` (its last input dimension), every other axis
    its own scales; read back in ``dtype``."""
    import qwix

    axis = axis % w.ndim
    others = [a for a in range(w.ndim) if a != axis]
    q = qwix.quantize(w.astype(jnp.float32), SCHEMES[check_scheme(scheme)], channelwise_axes=others,
                      tiled_axes={axis: block_size(w.shape[axis])})  # fmt: skip
    return Quantized(q.qvalue, q.scale.astype(jnp.float32), scheme, jnp.dtype(dtype))


def abstract(shape: tuple[int, ...], scheme: str, axis: int, dtype=jnp.float32) -> Quantized:
    """The ``jax.ShapeDtypeStruct`` leaves of :func:`quantize`'s result for a weight of ``shape``."""
    return jax.eval_shape(lambda: quantize(jnp.zeros(shape, jnp.float32), scheme, axis, dtype))


def shardings(weight: NamedSharding, q: Quantized) -> Quantized:
    """:class:`Quantized`'s shardings for a weight sharded as ``weight``: the codes as the
    weight; the scales as the weight where their dimension still divides over its mesh axes
    (the block axis has ``1/64`` of the entries), else whole along that dimension."""
    spec = tuple(weight.spec) + (None,) * (q.codes.ndim - len(weight.spec))
    sizes = dict(zip(weight.mesh.axis_names, weight.mesh.axis_sizes))

    def fits(entry, dim):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        return dim % math.prod(sizes[n] for n in names) == 0

    scale_spec = tuple(e if fits(e, d) else None for e, d in zip(spec, q.scales.shape))
    return Quantized(weight, NamedSharding(weight.mesh, P(*scale_spec)), q.scheme, q.dtype)


def _relative_error(w: jax.Array, q: Quantized) -> jax.Array:
    d = q.dequantize(jnp.float32) - w.astype(jnp.float32)
    return jnp.linalg.norm(d.ravel()) / jnp.maximum(jnp.linalg.norm(w.astype(jnp.float32).ravel()), 1e-30)


def error(w: jax.Array, q: Quantized) -> float:
    """The relative error of ``q`` against ``w``: ``|dequantized - w| / |w|`` (Frobenius)."""
    return float(_relative_error(w, q))


def block_axis(shape: tuple[int, ...], n_in: int, n_out: int) -> int:
    """The block axis of a weight of ``shape`` whose last ``n_in + n_out`` dimensions are its
    inputs then its outputs: the last input dimension (the leading ones are stacked layers or
    experts)."""
    return len(shape) - n_out - 1


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _replaced(tree: dict, path: tuple, value) -> dict:
    """``tree`` with the leaf at ``path`` replaced (the dicts along the path copied)."""
    if not path:
        return value
    return {**tree, path[0]: _replaced(tree[path[0]], path[1:], value)}


class Quantizer:
    """Quantizes the weights of ``targets`` (``{state path: (n_in, n_out)}``,
    :func:`nnxscale.layers.lora.stacked_weights`) one at a time as they come, each on the devices
    that hold it and sharded like it: ``q(path, w)`` returns ``w``'s :class:`Quantized` (``w``
    itself when ``path`` is not a target, or ``w`` is quantized already) and keeps its error
    for :meth:`report`."""

    def __init__(self, targets: dict[tuple, tuple[int, int]], scheme: str, dtype=jnp.float32):
        self.targets = {".".join(map(str, path)): dims for path, dims in targets.items()}
        self.scheme, self.dtype, self.errors = check_scheme(scheme), jnp.dtype(dtype), {}

    def __call__(self, path: tuple, w):
        key = ".".join(map(str, path))
        if key not in self.targets or is_quantized(w):
            return w
        axis = block_axis(w.shape, *self.targets[key])
        out = shardings(w.sharding, abstract(w.shape, self.scheme, axis, self.dtype))

        def run(w):
            q = quantize(w, self.scheme, axis, self.dtype)
            return q, _relative_error(w, q)

        q, err = jax.jit(run, out_shardings=(out, NamedSharding(w.sharding.mesh, P())))(w)
        self.errors.setdefault(key, []).append(err)
        return q

    def layer_by_layer(self, path: tuple) -> bool:
        """Whether ``path`` is a weight this quantizes: a loader then hands it one layer at a
        time (:meth:`__call__` on each) and joins the layers with :meth:`stack`, so no stacked
        weight is ever on the devices whole in full precision (a 70B model's stacked MLP
        weight is 37.6 GB in bfloat16)."""
        return ".".join(map(str, path)) in self.targets

    def stack(self, path: tuple, layers: list, sharding: NamedSharding) -> Quantized:
        """The :class:`Quantized` of a stacked weight from its layers' (``self(path, layer)``
        each), laid out as ``sharding`` lays out the stacked weight."""
        full = (len(layers),) + tuple(layers[0].codes.shape)
        axis = block_axis(full, *self.targets[".".join(map(str, path))])
        out = shardings(sharding, abstract(full, self.scheme, axis, self.dtype))
        return jax.jit(lambda qs: jax.tree.map(lambda *xs: jnp.stack(xs), *qs), out_shardings=out)(layers)

    def report(self, log: Optional[Callable[[str], None]]) -> None:
        """One line of the errors of the weights quantized so far (none: nothing)."""
        if log is None or not self.errors:
            return
        per_weight = {k: float(np.mean([float(e) for e in v])) for k, v in self.errors.items()}  # a stacked weight: its layers' mean
        e = np.array(list(per_weight.values()))
        worst = max(per_weight, key=per_weight.get)
        log(f"quantized base: {len(e)} weights stored {self.scheme} in blocks of {BLOCK}; relative error per tensor "
            f"{e.min():.4f} to {e.max():.4f} (mean {e.mean():.4f}; the largest: {worst})")  # fmt: skip


def quantize_params(params: dict, targets: dict[tuple, tuple[int, int]], scheme: str, dtype=jnp.float32,
                    log: Optional[Callable[[str], None]] = None) -> dict:  # fmt: skip
    """``params`` (a nested dict of sharded arrays) with each weight of ``targets`` replaced by
    its :class:`Quantized` (:class:`Quantizer`); ``log``: one line of their errors."""
    quantizer = Quantizer(targets, scheme, dtype)
    for path in targets:
        params = _replaced(params, path, quantizer(path, _get(params, path)))
    quantizer.report(log)
    return params


def quantize_abstract(tree: dict, targets: dict[tuple, tuple[int, int]], scheme: str, dtype=jnp.float32) -> dict:
    """:func:`quantize_params` on ``jax.ShapeDtypeStruct`` leaves carrying their shardings."""
    check_scheme(scheme)
    for path, (n_in, n_out) in targets.items():
        a = _get(tree, path)
        q = abstract(a.shape, scheme, block_axis(a.shape, n_in, n_out), dtype)
        sh = shardings(a.sharding, q)
        q = jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h), q, sh)
        tree = _replaced(tree, path, q)
    return tree
