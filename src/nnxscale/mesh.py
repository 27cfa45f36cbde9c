"""Meshes from a short spec: ``data=4,model=2``, ``fsdp=-1``, or a mapping.

Axis types: every mesh nnxscale builds uses ``AxisType.Auto``. With the default
``Explicit`` axes of ``jax.make_mesh``, Flax creates each Variable in full and reshards it
afterwards: measured on 8 CPU devices, a 128 MiB kernel needed 512 MiB of temporary memory
per device for a 16 MiB shard (33x). With Auto axes the output sharding propagates into
the random number generation, XLA partitions it, and the same init needs 3x the shard
(less for several layers; see ``bench/init_memory.py``). nnxscale expresses all of its
layouts with explicit ``NamedSharding`` objects and ``out_shardings``, so it gives up
nothing by using Auto axes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Union

import jax
from jax.sharding import AxisType, Mesh

from nnxscale.errors import MeshError

MeshSpec = Union[str, Mapping[str, int]]

_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_mesh_spec(spec: MeshSpec) -> dict[str, int]:
    """Parse ``"data=4,model=2"`` (or a mapping) into an ordered ``{axis: size}``.

    Sizes are positive integers, or ``-1`` for the single axis that takes all remaining
    devices (resolved by :func:`resolve_mesh_shape`). Raises :class:`MeshError` naming the
    offending entry.
    """
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    elif isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise MeshError("empty mesh spec: write axes as name=size, e.g. 'data=4,model=2' or 'fsdp=-1'")
        items = []
        for part in text.split(","):
            part = part.strip()
            if part.count("=") != 1:
                raise MeshError(
                    f"malformed mesh axis {part!r} in {spec!r}: write name=size, e.g. 'data=4,model=2'"
                )
            name, size = (s.strip() for s in part.split("="))
            try:
                size_int = int(size)
            except ValueError:
                raise MeshError(f"mesh axis {name!r} has size {size!r}, which is not an integer") from None
            items.append((name, size_int))
    else:
        raise MeshError(f"mesh spec must be a string like 'data=4,model=2' or a mapping, got {type(spec).__name__}")

    axes: dict[str, int] = {}
    for name, size in items:
        if not _AXIS_NAME.match(name):
            raise MeshError(f"bad mesh axis name {name!r}: use letters, digits and '_', starting with a letter")
        if name in axes:
            raise MeshError(f"mesh axis {name!r} appears twice in {spec!r}")
        if isinstance(size, bool) or not isinstance(size, int):
            raise MeshError(f"mesh axis {name!r} has size {size!r}, which is not an integer")
        if size == 0 or size < -1:
            raise MeshError(f"mesh axis {name!r} has size {size}: sizes are positive, or -1 for 'all remaining devices'")
        axes[name] = size
    if list(axes.values()).count(-1) > 1:
        wild = [n for n, s in axes.items() if s == -1]
        raise MeshError(f"only one mesh axis may be -1, got {wild}")
    return axes


def resolve_mesh_shape(spec: MeshSpec, num_devices: int) -> dict[str, int]:
    """Resolve a spec against ``num_devices``: fill in ``-1`` and check the product."""
    axes = parse_mesh_spec(spec)
    known = math.prod(s for s in axes.values() if s != -1)
    if -1 in axes.values():
        wild = next(n for n, s in axes.items() if s == -1)
        if num_devices % known:
            raise MeshError(
                f"mesh {format_mesh(axes)}: the other axes use {known} devices, which does not divide "
                f"the {num_devices} devices available, so {wild}=-1 has no size"
            )
        axes[wild] = num_devices // known
    product = math.prod(axes.values())
    if product != num_devices:
        raise MeshError(
            f"mesh {format_mesh(axes)} needs {product} devices, this job has {num_devices}: "
            f"make the sizes multiply to {num_devices}, or use -1 for one axis"
        )
    return axes


def format_mesh(axes: Mapping[str, int]) -> str:
    """``{"data": 4, "model": 2}`` -> ``"data=4,model=2"``."""
    return ",".join(f"{k}={v}" for k, v in axes.items())


def make_mesh(spec: MeshSpec, devices=None) -> Mesh:
    """Build a :class:`jax.sharding.Mesh` over all global devices from a short spec.

    Args:
      spec: ``"data=4,model=2"``, ``"fsdp=-1"``, ``"data=2,fsdp=2,tensor=2"`` or a mapping
        ``{"data": 4, "model": 2}``. Axis order is the order written; the last axis varies
        fastest over devices, so put the axis with the most traffic (tensor parallel) last.
      devices: defaults to ``jax.devices()``, the devices of every process.

    All axes are ``AxisType.Auto`` (see the module docstring for the measured reason).
    """
    devices = list(jax.devices() if devices is None else devices)
    axes = resolve_mesh_shape(spec, len(devices))
    shape = tuple(axes.values())
    names = tuple(axes.keys())
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def mesh_axis_sizes(mesh) -> dict[str, int]:
    """``{axis: size}`` of a ``jax.sharding.Mesh`` (or a mapping, returned as a dict)."""
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    return dict(mesh.shape)
