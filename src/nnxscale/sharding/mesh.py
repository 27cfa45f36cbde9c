"""Meshes from a short spec: ``data=4,model=2``, ``fsdp=-1``, or a mapping.

Axis types: every mesh nnxscale builds uses ``AxisType.Auto``. With the default
``Explicit`` axes of ``jax.make_mesh``, Flax creates each Variable in full and reshards it
afterwards: measured on 8 CPU devices, a 128 MiB kernel needed 512 MiB of temporary memory
per device for a 16 MiB shard (33x). With Auto axes the output sharding propagates into
the random number generation, XLA partitions it, and the same init needs 3x the shard
(less for several layers; see ``bench/init_memory.py``). nnxscale expresses all of its
layouts with explicit ``NamedSharding`` objects and ``out_shardings``, so it gives up
nothing by using Auto axes.

Several processes (a ``jax.distributed`` job): the mesh is laid over processes the way
JAX's hybrid helper does (``mesh_utils.create_hybrid_device_mesh(...,
process_is_granule=True)``). The processes are spread over the *leading* axes and the
trailing axes stay inside a process, so ``data=4,model=2`` on 2 processes of 4 devices
keeps each ``model`` pair on one process and splits ``data`` 2 ways across processes. An
axis that crosses hosts while it carries tensor parallelism (``model``/``tensor``) is
legal but slow, and :func:`process_findings` says so.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Union

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from nnxscale.errors import MeshError
from nnxscale.sharding.axes import TENSOR_PARALLEL_AXES

MeshSpec = Union[str, Mapping[str, int]]

_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Mesh axes that carry tensor parallelism under the rules presets: their collectives run
#: inside every layer, so they belong on the fast links inside one host.


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

    When the devices belong to several processes, the processes are spread over the
    leading axes (:func:`process_split`) and the mesh is JAX's hybrid mesh, so that every
    process holds a contiguous block of the leading axes and whole trailing axes. Raises
    :class:`MeshError` when the processes have different numbers of devices.

    All axes are ``AxisType.Auto`` (see the module docstring for the measured reason).
    """
    devices = list(jax.devices() if devices is None else devices)
    axes = resolve_mesh_shape(spec, len(devices))
    shape = tuple(axes.values())
    names = tuple(axes.keys())
    axis_types = (AxisType.Auto,) * len(names)
    per_process = _devices_per_process(devices)
    if len(per_process) == 1:
        return jax.make_mesh(shape, names, axis_types=axis_types, devices=devices)
    across, within = process_split(axes, len(per_process))
    try:
        grid = mesh_utils.create_hybrid_device_mesh(
            tuple(within.values()), tuple(across.values()), devices, process_is_granule=True
        )
    except ValueError as e:  # an accelerator topology that cannot hold the per-process shape
        raise MeshError(
            f"mesh {format_mesh(axes)} cannot be laid over {len(per_process)} processes as "
            f"{format_mesh(across)} across processes x {format_mesh(within)} inside each ({e})"
        ) from None
    return Mesh(grid, names, axis_types=axis_types)


def _devices_per_process(devices) -> dict[int, int]:
    counts: dict[int, int] = {}
    for d in devices:
        counts[d.process_index] = counts.get(d.process_index, 0) + 1
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"process {p}: {n}" for p, n in sorted(counts.items()))
        raise MeshError(
            f"the processes of this job have different numbers of devices ({listed}): a mesh is laid "
            "over processes of equal size; give every process the same devices (e.g. the same --cpu-devices)"
        )
    return counts


def process_split(spec: MeshSpec, num_processes: int) -> tuple[dict[str, int], dict[str, int]]:
    """Split each axis into ``(across processes, inside a process)`` sizes.

    The processes go to the leading axes first: axis by axis, in the order written, each
    takes the largest share of the processes still unplaced that divides its size. So
    ``data=4,model=2`` over 2 processes is ``data=2`` across x ``data=2,model=2`` inside,
    and ``fsdp=8`` over 2 processes is ``fsdp=2`` across x ``fsdp=4`` inside. The product
    of the inside sizes is the number of devices of one process.

    Raises :class:`MeshError` when the axes cannot absorb the processes (e.g. ``data=3``
    over 2 processes).
    """
    axes = parse_mesh_spec(spec)
    if -1 in axes.values():
        raise MeshError(f"mesh {format_mesh(axes)}: resolve -1 against the device count first (resolve_mesh_shape)")
    across: dict[str, int] = {}
    left = num_processes
    for name, size in axes.items():
        across[name] = math.gcd(size, left)
        left //= across[name]
    if left != 1:
        raise MeshError(
            f"mesh {format_mesh(axes)} cannot be split over {num_processes} processes: each process must "
            f"hold an equal block of devices, so the axis sizes must multiply to a multiple of {num_processes}"
        )
    within = {name: size // across[name] for name, size in axes.items()}
    return across, within


def process_findings(mesh, hosts: Sequence[str] = ()) -> list[str]:
    """Lint for a mesh over several processes: tensor parallelism that crosses hosts.

    One line per ``model``/``tensor`` axis along which the devices belong to more than one
    host (read from the mesh's own devices, whoever built it): its collectives run in
    every layer, over the slow links between hosts. ``hosts`` names each process's host,
    by process id (``nnxscale.jobs.distributed.current().hosts``); without it every process
    counts as a host. Empty when the mesh is on one host.
    """
    owner = np.vectorize(lambda d: hosts[d.process_index] if hosts else d.process_index, otypes=[object])(mesh.devices)
    per_host: dict = {}
    for o in owner.flat:
        per_host[o] = per_host.get(o, 0) + 1
    if len(per_host) == 1:
        return []
    unit = "hosts" if hosts else "processes"
    findings = []
    for i, name in enumerate(mesh.axis_names):
        if name not in TENSOR_PARALLEL_AXES:
            continue
        lines = np.moveaxis(owner, i, -1).reshape(-1, owner.shape[i])  # one row per line along the axis
        spread = max(len(set(row)) for row in lines)
        if spread > 1:
            findings.append(
                f"[slow interconnect] mesh axis {name}={owner.shape[i]} spans {spread} {unit}: tensor parallelism "
                "across hosts sends every layer's activations over the network between hosts; keep "
                f"{name} inside one host: at most {min(per_host.values())} (the devices of one) and after the "
                "data/fsdp axes in --mesh"
            )
    return findings


def mesh_axis_sizes(mesh) -> dict[str, int]:
    """``{axis: size}`` of a ``jax.sharding.Mesh`` (or a mapping, returned as a dict)."""
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    return dict(mesh.shape)


def context_mesh(mesh):
    """The mesh to hand ``jax.shard_map``: ``mesh``, or the context's view of it.

    Inside another shard_map over the same mesh (a TP layer under
    :func:`data_parallel_apply`) the context mesh has some axes Manual, and shard_map
    requires that abstract mesh rather than the concrete one.
    """
    ctx = jax.sharding.get_abstract_mesh()
    if not ctx.empty and ctx.manual_axes and (ctx.axis_names, ctx.axis_sizes) == (mesh.axis_names, mesh.axis_sizes):
        return ctx
    return mesh


def varying_axes(x) -> set:
    """The manual mesh axes over which ``x`` may differ from device to device (inside ``shard_map``)."""
    kind = jax.typeof(x)
    manual = getattr(kind, "manual_axis_type", None)  # jax 0.10; before, the set was `.vma`
    return set(manual.varying if manual is not None else getattr(kind, "vma", ()))


def varying_like(tree, *refs):
    """``tree`` varying over every manual mesh axis that one of ``refs`` varies over.

    Inside ``shard_map`` (a ring or a mixture of experts nested in a pipeline stage) a
    loop's carry, both branches of a ``cond`` and a custom gradient's results must have
    the types of what they stand for, manual axes included; zeros made there vary over
    none until told. Outside ``shard_map``, ``tree`` unchanged."""
    return vary(tree, set().union(*map(varying_axes, jax.tree.leaves(refs))))


def vary(tree, axes):
    """Every leaf of ``tree`` varying over the manual mesh ``axes`` (those it does not vary over yet)."""

    def cast(x):
        more = tuple(sorted(set(axes) - varying_axes(x)))
        return jax.lax.pcast(x, more, to="varying") if more else x

    return jax.tree.map(cast, tree) if axes else tree


def sum_to_type(grad, primal):
    """``grad`` summed over the manual axes it varies over and ``primal`` does not: the
    gradient of a value used the same on every device of those axes (a custom gradient's
    result must have its operand's type). ``grad`` unchanged outside ``shard_map``."""
    extra = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
    return jax.lax.psum(grad, extra) if extra else grad
