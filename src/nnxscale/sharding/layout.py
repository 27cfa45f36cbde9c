"""Pure shape arithmetic: per-device shard shapes and bytes, with or without devices.

``mesh`` is a ``jax.sharding.Mesh`` or a plain mapping ``{axis: size}``, so a layout can
be planned for a mesh that does not exist on this machine (a 2x4 mesh on a laptop, a
1024-chip pod). Results agree with ``NamedSharding(mesh, spec).shard_shape(shape)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from jax.sharding import PartitionSpec as P

from nnxscale.errors import LayoutError
from nnxscale.sharding.axes import entry_axes
from nnxscale.sharding.mesh import mesh_axis_sizes


def shard_shape(global_shape: Sequence[int], spec, mesh) -> tuple[int, ...]:
    """Per-device shape of a tensor of ``global_shape`` laid out by ``spec`` on ``mesh``.

    Each spec entry is ``None`` (replicated), a mesh axis name (divided by that axis's
    size) or a tuple of names (divided by the product). Missing trailing entries are
    replicated; ``P()`` replicates the whole tensor.

    Raises :class:`LayoutError` (a ``ValueError``) for a spec longer than the rank, an
    unknown mesh axis, a mesh axis used twice, or a dimension its shard count does not divide.
    """
    sizes = mesh_axis_sizes(mesh)
    shape = tuple(int(d) for d in global_shape)
    spec = tuple(spec) if spec is not None else ()
    if len(spec) > len(shape):
        raise LayoutError(
            f"PartitionSpec {P(*spec)} has {len(spec)} entries but the tensor {shape} has rank {len(shape)}"
        )
    used: dict[str, int] = {}
    out = list(shape)
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        for a in axes:
            if a not in sizes:
                raise LayoutError(
                    f"PartitionSpec {P(*spec)} names mesh axis {a!r}, but the mesh has axes {tuple(sizes)}"
                )
            if a in used:
                raise LayoutError(
                    f"PartitionSpec {P(*spec)} uses mesh axis {a!r} twice (dimensions {used[a]} and {dim}); "
                    "a mesh axis can shard only one dimension"
                )
            used[a] = dim
        count = math.prod(sizes[a] for a in axes)
        if shape[dim] % count:
            raise LayoutError(
                f"dimension {dim} of shape {shape} has size {shape[dim]}, which is not divisible by "
                f"{count} (mesh axes {axes} of sizes {tuple(sizes[a] for a in axes)})"
            )
        out[dim] = shape[dim] // count
    return tuple(out)


#: Dtypes of fewer than 8 bits, which XLA packs two to a byte on a device (numpy stores each in a byte).
HALF_BYTE = ("int4", "uint4", "float4_e2m1fn")


def itemsize(dtype) -> float:
    """Bytes per element on a device; works for numpy dtypes, names like "bfloat16", and JAX
    key dtypes. 4-bit codes (``--quantize-base nf4``) take half a byte."""
    try:
        d = np.dtype(dtype)
    except TypeError:  # extended dtypes (PRNG keys) are not numpy dtypes but know their size
        return int(dtype.itemsize)
    return 0.5 if d.name in HALF_BYTE else d.itemsize


def shard_bytes(global_shape: Sequence[int], dtype, spec, mesh) -> int:
    """Bytes one device holds for a tensor laid out by ``spec`` on ``mesh``."""
    return int(math.prod(shard_shape(global_shape, spec, mesh)) * itemsize(dtype))


def full_bytes(global_shape: Sequence[int], dtype) -> int:
    """Bytes of the whole, unsharded tensor."""
    return int(math.prod(int(d) for d in global_shape) * itemsize(dtype))


def state_bytes(shapes_and_specs, mesh) -> tuple[int, int]:
    """``(bytes per device, bytes unsharded)`` for an iterable of ``(shape, dtype, spec)``.

    The per-device figure is what the largest-holding device stores: shardings here are
    even, so every device holds the same number of bytes.
    """
    per_device = 0
    full = 0
    for shape, dtype, spec in shapes_and_specs:
        per_device += shard_bytes(shape, dtype, spec, mesh)
        full += full_bytes(shape, dtype)
    return per_device, full


def format_bytes(n: float) -> str:
    """``134217728`` -> ``"128.0 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
