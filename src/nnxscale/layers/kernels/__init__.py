"""The attention kernels an accelerator runs, behind :func:`nnxscale.layers.attention.attention`.

- :mod:`.splash`: TPU, the Pallas splash attention shipped in JAX
  (``jax.experimental.pallas.ops.tpu.splash_attention``);
- :mod:`.gpu_flash`: NVIDIA, a Pallas GPU flash attention: the one shipped in JAX
  (``jax.experimental.pallas.ops.gpu.attention``) where jax has it (to 0.12.0), else
  nnxscale's (:mod:`.triton_flash`), for what cuDNN's fused attention
  (``jax.nn.dot_product_attention(implementation="cudnn")``) does not take here.

Both take the layout of :func:`~nnxscale.layers.attention.attention` (queries ``(B, T, N, H)``,
keys and values ``(B, S, K, H)``), a causal mask by position in the sequence and document ids,
a sliding window, a logit soft cap and a softmax scale (splash also values of another width,
``(B, S, K, Hv)``), and pad any length to whole tiles. A Pallas kernel is one opaque call to the compiler, which
cannot split it over a mesh as it splits plain JAX: :func:`per_device` runs it on each device's
rows and heads (``jax.shard_map`` over the mesh axes that split them). Each kernel runs in Pallas
interpret mode (``interpret=True``) on any machine, which is how the tests check it on CPU.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nnxscale.sharding.activations import current_rules, local_layout, manual_axes
from nnxscale.sharding.axes import entry_axes
from nnxscale.sharding.mesh import context_mesh

Q_NAMES = ("batch", "length", "heads", "kv")
KV_NAMES = ("batch", "length", "kv_heads", "kv")


def per_device(kernel: Callable, q, k, v, q_segments, k_segments):
    """``kernel(q, k, v, q_segments, k_segments)`` on each device's share of the batch and
    heads, laid out as the activation rules in force lay ``q`` and ``k`` out (the length is
    whole here: a split sequence is a ring). Without rules or on one device, ``kernel`` as is.
    Segments are ``(B, T)`` / ``(B, S)`` arrays or None."""
    rules = current_rules()
    if rules is None or rules.num_devices == 1:
        return kernel(q, k, v, q_segments, k_segments)
    manual = manual_axes()  # left out: split already
    q_spec = local_layout(rules, Q_NAMES, q.shape, manual).spec
    kv_spec = local_layout(rules, KV_NAMES, k.shape, manual).spec
    batch = q_spec[0] if q_spec[0] == kv_spec[0] else None
    # Query head n reads key/value head n // (N / K): the heads split alike on both, or not at all.
    heads = q_spec[2] if q_spec[2] == kv_spec[2] else None
    axes = frozenset(a for e in (batch, heads) for a in entry_axes(e))
    if not axes:
        return kernel(q, k, v, q_segments, k_segments)
    x_spec, s_spec = P(batch, None, heads, None), P(batch, None)
    seg = (q_segments, k_segments)
    seg_specs = tuple(None if s is None else s_spec for s in seg)
    mesh = rules.mesh if isinstance(rules.mesh, jax.sharding.Mesh) else jax.sharding.get_abstract_mesh()
    return jax.shard_map(kernel, mesh=context_mesh(mesh), in_specs=(x_spec, x_spec, x_spec, *seg_specs),
                         out_specs=x_spec, axis_names=axes, check_vma=False)(q, k, v, *seg)  # fmt: skip


def padded(n: int, block: int) -> int:
    """``n`` rounded up to whole blocks."""
    return -(-n // block) * block


def pad_tokens(x, n: int, fill=0):
    """``x`` padded along axis 1 (tokens) to ``n`` with ``fill``."""
    if x.shape[1] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n - x.shape[1])
    return jnp.pad(x, pad, constant_values=fill)
