"""FP8 matrix products for the linear layers (``--fp8``).

A linear layer's product ``y = x W`` runs on FP8 operands: ``x`` and ``W`` quantized to
``float8_e4m3fn`` (3 mantissa bits: precision for values) in the forward pass, the incoming
gradient ``dy`` to ``float8_e5m2`` (2 mantissa bits, 5 exponent bits: range, which gradients
need) in the backward pass, so all three GEMMs of a layer (``y = x W``, ``dx = dy W^T``,
``dW = x^T dy``) take FP8 operands and accumulate in float32. The master weights, the
optimizer state and everything outside these products stay as they are.

**Scaling: current (dynamic), per tensor.** Each operand is scaled by its own absolute
maximum, taken from the tensor being quantized (``qwix.quantize``, absmax calibration, one
float32 scale per tensor), not from a history of earlier steps (delayed scaling). Current
scaling keeps nothing between steps: no amax history to shard, checkpoint or restore, so a
run resumes exactly and runs on any mesh as its bfloat16 run does, and the first steps are
scaled as well as the rest. It costs one reduction of each operand (an all-reduce of one
float32 where the tensor is sharded) per product. torchtitan's float8 (torchao) scales this
way by default ("tensorwise" dynamic scaling).

**Why the products are written here, with Qwix's quantizer and its dot.** The operands are
``qwix.QArray`` s, and the product is ``qwix.dot_general`` on them, which multiplies the FP8
values (``lax.dot_general`` on ``float8`` operands, float32 result) and applies the scales
afterwards. That is the form XLA:GPU compiles to an FP8 GEMM on Hopper and later; a product of
dequantized values (``convert(f8) * scale`` before the dot) compiled to a bfloat16 GEMM on
jaxlib 0.12.1's H100 compiler. Qwix's own quantized training (``QtProvider``) reaches a layer by
intercepting the model's calls while it traces it, which the scanned, sharded stacks of
:mod:`nnxscale.layers.stack` are not built for; its FP8 defaults scale per channel. The
gradient here is a ``jax.custom_vjp``: the forward keeps its FP8 operands (half the bytes of
bfloat16 residuals), the backward quantizes ``dy`` and runs the two gradient products in FP8.

On XLA:CPU the FP8 values are emulated (converted for the product); the numbers are the FP8
run's, which is what the tests check. :func:`attach` sets the products of a model's stacked
layers; the embedding, the head (the loss's own product) and a mixture's grouped experts
(``ragged_dot``) stay in the compute dtype, and ``plan`` reports the share of the step's
matrix FLOPs that run in FP8.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from nnxscale.errors import ConfigError

FORWARD = jnp.float8_e4m3fn
BACKWARD = jnp.float8_e5m2


def _quantize(x, qtype):
    return qwix.quantize(x, qtype, scale_dtype=jnp.float32)


def _product(a, b, contracted: int, lhs_first: bool, dtype):
    """``a`` (free..., k...) x ``b`` (k..., free...) over ``contracted`` dimensions, or with
    ``lhs_first`` False over ``a``'s leading and ``b``'s leading ones (the weight gradient)."""
    if lhs_first:
        dims = (tuple(range(a.qvalue.ndim - contracted, a.qvalue.ndim)), tuple(range(contracted)))
    else:
        dims = (tuple(range(contracted)), tuple(range(contracted)))
    return qwix.dot_general(a, b, (dims, ((), ())), preferred_element_type=dtype)


@functools.lru_cache(maxsize=None)
def _matmul(k: int, dtype, x_dtype, w_dtype):
    """``(x, w) -> x . w``: ``x`` (free..., k...) times ``w`` (k..., free...), contracting
    ``k`` dimensions, in FP8, the result in ``dtype``; its gradients in ``x_dtype`` and ``w_dtype``."""

    def forward(x, w):
        qx, qw = _quantize(x, FORWARD), _quantize(w, FORWARD)
        return _product(qx, qw, k, True, dtype), (qx, qw)

    def backward(res, g):
        qx, qw = res
        qg = _quantize(g, BACKWARD)
        free_x, free_w = qx.qvalue.ndim - k, qw.qvalue.ndim - k
        # dx (free_x..., k...) = dy (free_x..., free_w...) . W (k..., free_w...) over W's free dimensions
        dx = qwix.dot_general(qg, qw, ((tuple(range(free_x, free_x + free_w)), tuple(range(k, k + free_w))), ((), ())),
                              preferred_element_type=x_dtype)  # fmt: skip
        # dW (k..., free_w...) = x (free_x..., k...) . dy (free_x..., free_w...) over x's free dimensions
        dw = _product(qx, qg, free_x, False, w_dtype)
        return dx, dw

    matmul = jax.custom_vjp(lambda x, w: forward(x, w)[0])
    matmul.defvjp(forward, backward)
    return matmul


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None, **kwargs):
    """``jax.lax.dot_general`` with FP8 operands (see the module docstring), for products
    without batch dimensions: a linear layer's. A product with batch dimensions, an explicit
    output sharding or non-float operands runs as ``jax.lax.dot_general`` does."""
    (lc, rc), (lb, rb) = dimension_numbers
    floats = all(jnp.issubdtype(a.dtype, jnp.floating) for a in (lhs, rhs))
    if lb or rb or out_sharding is not None or not floats:
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, out_sharding=out_sharding, **kwargs)  # fmt: skip
    lc, rc = tuple(lc), tuple(rc)
    # Canonical operands: lhs (free..., contracted...), rhs (contracted..., free...), in the
    # same order of contracted dimensions; the output's dimensions are then dot_general's.
    perm_l = tuple(d for d in range(lhs.ndim) if d not in lc) + lc
    perm_r = rc + tuple(d for d in range(rhs.ndim) if d not in rc)
    lhs = lhs if perm_l == tuple(range(lhs.ndim)) else jnp.transpose(lhs, perm_l)
    rhs = rhs if perm_r == tuple(range(rhs.ndim)) else jnp.transpose(rhs, perm_r)
    dtype = jnp.dtype(preferred_element_type) if preferred_element_type is not None else jnp.result_type(lhs, rhs)
    return _matmul(len(lc), dtype, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))(lhs, rhs)


def einsum(subscripts, *operands, **kwargs):
    """``jnp.einsum`` whose products are :func:`dot_general`'s (``nnx.Einsum``'s ``einsum_op``)."""
    return jnp.einsum(subscripts, *operands, _dot_general=dot_general, **kwargs)


def check_devices(mesh) -> None:
    """A :class:`~nnxscale.errors.ConfigError` line where ``mesh``'s devices are NVIDIA GPUs
    without FP8 matrix units (compute capability below 8.9: A100, ...); CPUs emulate FP8."""
    if not isinstance(mesh, jax.sharding.Mesh):  # an AbstractMesh plans for devices elsewhere (plan checks its target)
        return
    device = mesh.devices.flat[0]
    capability = getattr(device, "compute_capability", None) if device is not None and device.platform == "gpu" else None
    if capability is not None and tuple(int(p) for p in str(capability).split(".")[:2]) < (8, 9):
        raise ConfigError(f"--fp8: {device.device_kind} (compute capability {capability}) has no FP8 matrix units "
                          "(Ada and Hopper on, 8.9+, have them); train without --fp8")  # fmt: skip


def attach(model: nnx.Module, modules) -> int:
    """Run the products of ``modules`` (``nnx.Linear`` or ``nnx.Einsum`` layers of ``model``,
    LoRA's included) in FP8; returns how many. Set on the layers (their ``dot_general`` or
    ``einsum_op``): the parameters and their shardings are unchanged."""
    count = 0
    for module in modules:
        if isinstance(module, nnx.Linear):
            module.dot_general = dot_general
        elif isinstance(module, nnx.Einsum):
            module.einsum_op = einsum
        else:
            continue
        count += 1
    return count
