"""State sharding: from an NNX model (or its state) and a rules table to a sharded layout.

This module is the one seam between nnxscale and Flax/JAX sharding APIs: everything that
turns logical axis names into PartitionSpecs, NamedShardings and placed arrays lives here.

Trees returned here have the structure of ``nnx.state(model)`` with each Variable
replaced by its PartitionSpec / NamedSharding (as ``jax.tree.map(pick_spec, state,
is_leaf=...)`` would give). Such a tree is a valid prefix for ``jax.device_put`` and for
``jax.jit(out_shardings=...)``.

Where a Variable's logical axes come from (first that applies):

1. ``logical_axes`` metadata, set by :func:`nnxscale.logical` (nnxscale's way);
2. Flax's ``out_sharding`` metadata (``nnx.with_partitioning``), each name run through the
   rules (a name that is itself a mesh axis maps to it);
3. the *fallback* for unannotated parameters: a 2-D kernel is taken as ``(embed, mlp)``
   and a 1-D bias as ``(mlp,)``, then resolved by the parameter rules like any other, so
   the preset decides (``dp`` replicates them, ``fsdp`` splits the kernel's rows, ``tp``
   its columns). Other ranks and non-parameter Variables (RNG state, counters) are
   replicated. :func:`lint` reports every Variable that used the fallback.

Every function here takes ``rules`` as a preset name, a rules string, a table, an
:class:`~nnxscale.AxisRules`, or rules already resolved against the mesh
(:class:`~nnxscale.MeshRules`, which also carries ``min_shard_bytes``). Specs are
always valid: a mesh axis whose size does not divide the dimension, or that an earlier
dimension already uses, is dropped (that dimension is replicated over it), and
:func:`lint` reports the drop. Explicit PartitionSpecs given to
:func:`nnxscale.shard_shape` are checked strictly instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.jobs.distributed import cache_without_collectives
from nnxscale.sharding.axes import STAGE, entry_axes
from nnxscale.sharding.hlo_text import runs_collectives
from nnxscale.sharding.layout import (
    LayoutError,
    format_bytes,
    full_bytes,
    shard_bytes,
    shard_shape,
)
from nnxscale.sharding.rules import LOGICAL_KEY, NOT_SPLIT, PRESETS, MeshRules, resolve


def is_variable(x) -> bool:
    """Whether ``x`` is an ``nnx.Variable``: the ``is_leaf`` of every walk over a state tree."""
    return isinstance(x, nnx.Variable)


def _as_state(tree):
    """A Module becomes its state; a State (or any tree of Variables) is returned as is."""
    if isinstance(tree, nnx.Module):
        return nnx.state(tree)
    return tree


def path_str(path) -> str:
    """A tree path as a Variable's dotted name: ``h.0.attn.kernel``."""
    parts = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        parts.append(str(key))
    return ".".join(parts)


def _shape_dtype(v: nnx.Variable):
    value = v.get_value() if hasattr(v, "get_value") else v[...]
    return tuple(getattr(value, "shape", ())), getattr(value, "dtype", np.dtype("float32"))


def variable_logical_axes(v: nnx.Variable) -> Optional[tuple]:
    """The logical axis names a Variable was annotated with, or ``None``."""
    meta = v.get_metadata()
    names = meta.get(LOGICAL_KEY)
    if names is None:
        names = meta.get("out_sharding")
    if names is None:
        return None
    if isinstance(names, P):
        names = tuple(names)
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class VariableLayout:
    """How one Variable is laid out: what the rules decided and why."""

    path: str
    shape: tuple[int, ...]
    dtype: Any
    logical: Optional[tuple]  # None: unannotated
    spec: P
    fallback: bool  # the rank rule or plain replication decided, not the rules
    dropped: tuple  # DroppedAxis per mesh axis a dimension did not get (indivisible, reused, kept whole)
    unmatched: tuple[str, ...]  # logical names no rule mentions and that are not mesh axes
    is_param: bool


#: Logical names an unannotated parameter is taken to have, by rank (see the module docstring).
FALLBACK_NAMES = {2: ("embed", "mlp"), 1: ("mlp",)}


def _layout_variable(path: str, v: nnx.Variable, rules: MeshRules) -> VariableLayout:
    shape, dtype = _shape_dtype(v)
    is_param = isinstance(v, nnx.Param)
    names = variable_logical_axes(v)
    fallback = names is None
    if fallback:
        if not is_param or len(shape) not in FALLBACK_NAMES:
            return VariableLayout(path, shape, dtype, None, P(), True, (), (), is_param)
        names = FALLBACK_NAMES[len(shape)]
    if names == () and shape:  # Flax's out_sharding=() means "replicated"
        names = (None,) * len(shape)
    if len(names) != len(shape):
        raise LayoutError(
            f"{path} is annotated with logical axes {names} ({len(names)} names) "
            f"but its value has shape {shape} (rank {len(shape)})"
        )
    lay = rules.param_layout(names, shape, dtype)
    if fallback:  # the names are stand-ins: the lint reports "unannotated", not their rules
        return VariableLayout(path, shape, dtype, None, lay.spec, True, (), (), is_param)
    return VariableLayout(path, shape, dtype, names, lay.spec, False, lay.dropped, lay.unmatched, is_param)


def layouts(tree, mesh, rules=None) -> list[VariableLayout]:
    """One :class:`VariableLayout` per Variable of a model or state, in state order."""
    resolved = resolve(rules, mesh)
    state = _as_state(tree)
    out = []
    for path, v in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)[0]:
        if is_variable(v):
            out.append(_layout_variable(path_str(path), v, resolved))
    return out


def state_specs(tree, mesh, rules=None):
    """Tree of PartitionSpecs, same structure as ``nnx.state(tree)``.

    ``mesh`` may be a ``Mesh`` or a plain ``{axis: size}`` mapping (planning only).
    """
    resolved = resolve(rules, mesh)
    state = _as_state(tree)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)
    specs = [_layout_variable(path_str(path), v, resolved).spec if is_variable(v) else P() for path, v in flat]
    return jax.tree_util.tree_unflatten(treedef, specs)


def state_shardings(tree, mesh, rules=None):
    """Tree of NamedShardings on ``mesh``, same structure as ``nnx.state(tree)``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(tree, mesh, rules))


#: Within :func:`shared_abstract_models`: the models :func:`abstract_state` traced, by key.
_SHARED_MODELS: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("nnxscale_abstract_models", default=None)


@contextlib.contextmanager
def shared_abstract_models():
    """Within the block, :func:`abstract_state` traces each model (each ``key``) once: what a
    sweep of meshes needs, whose candidates build the same model. Its variables' shapes,
    dtypes and logical names do not depend on the mesh (checked for every family on data,
    FSDP, tensor, pipeline, context and expert meshes); their shardings are laid out per call."""
    token = _SHARED_MODELS.set({})
    try:
        yield
    finally:
        _SHARED_MODELS.reset(token)


def abstract_state(factory: Callable[[], nnx.Module], mesh, rules=None, *, key: Optional[Hashable] = None):
    """``(graphdef, state)`` of the model ``factory()`` would build, without building it.

    Each Variable of ``state`` holds a ``jax.ShapeDtypeStruct`` carrying its target
    ``NamedSharding``: the restore target for checkpoints and the plan for sharded init.
    ``key``: what identifies the model ``factory`` builds, whatever the mesh; within
    :func:`shared_abstract_models` a model already traced under its key is not traced again.
    """
    shared = _SHARED_MODELS.get() if key is not None else None
    if shared is not None and key in shared:
        graphdef, state = shared[key]
    else:
        # Flax's eager sharding needs a mesh for out_sharding-annotated models; a plan for a mesh
        # larger than this machine has only an AbstractMesh (axis names and sizes, no devices).
        context = jax.sharding.use_abstract_mesh if isinstance(mesh, jax.sharding.AbstractMesh) else jax.set_mesh
        with context(mesh):
            graphdef, state = nnx.split(nnx.eval_shape(factory))
        if shared is not None:
            shared[key] = (graphdef, state)
    shardings = state_shardings(state, mesh, rules)

    def with_sharding(v, sharding):
        shape, dtype = _shape_dtype(v)
        return v.replace(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))

    return graphdef, jax.tree.map(with_sharding, state, shardings, is_leaf=is_variable)


#: Per-device bytes of parameters created by one compiled init program. Each program's
#: temporary memory is about 1.3x the bytes it creates, so peak init memory per device is
#: the sharded model plus about 1.3x this (or 3x the largest single shard).
INIT_GROUP_BYTES = 64 << 20


@dataclasses.dataclass
class InitProgram:
    """Sharded creation of a model, compiled as one or more programs (groups of Variables).

    The factory is traced once; each group is a jitted evaluation of that one trace that
    keeps only the group's outputs (XLA removes the rest), so a device never holds more than
    the model's shards plus one group's temporaries.
    """

    graphdef: Any
    treedef: Any
    groups: list  # list of lists of leaf indices into the state's leaves
    compiled: list  # one compiled program per group
    mesh: Any

    def memory(self) -> dict[str, int]:
        """Per-device bytes from the compiler's own analysis.

        ``peak``: the most any point of the init holds (earlier groups' outputs, then one
        group's temporaries and outputs); ``output``: the sharded model; ``temp``: the
        largest temporary allocation of any group.
        """
        done = peak = temp = 0
        for c in self.compiled:
            ma = c.memory_analysis()
            peak = max(peak, done + ma.temp_size_in_bytes + ma.output_size_in_bytes)
            temp = max(temp, ma.temp_size_in_bytes)
            done += ma.output_size_in_bytes
        return {"peak": peak, "output": done, "temp": temp, "programs": len(self.compiled)}

    def run(self):
        """Create the state (leaves placed per the rules) and return it as an nnx State."""
        leaves = [None] * sum(len(g) for g in self.groups)
        with jax.set_mesh(self.mesh):
            for group, program in zip(self.groups, self.compiled):
                for i, value in zip(group, program()):
                    leaves[i] = value
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def compile_init(factory: Callable[[], nnx.Module], mesh, rules=None, *, group_bytes: int = INIT_GROUP_BYTES,
                 abstract=None) -> InitProgram:  # fmt: skip
    """Plan and compile the sharded creation of ``factory()`` without running it.

    ``InitProgram.memory()`` gives the per-device peak before anything is allocated.
    ``abstract``: :func:`abstract_state`'s ``(graphdef, state)`` for these arguments, when the
    caller has it already (one trace of the model fewer).
    """
    graphdef, abstract = abstract_state(factory, mesh, rules) if abstract is None else abstract
    variables, treedef = jax.tree_util.tree_flatten(abstract, is_leaf=is_variable)
    shardings = [v.get_value().sharding for v in variables]
    with jax.set_mesh(mesh):
        closed = jax.make_jaxpr(lambda: jax.tree_util.tree_leaves(nnx.split(factory())[1]))()
    # Variables flatten to one leaf each, in the same order as the state's leaves.
    assert len(closed.jaxpr.outvars) == len(variables), "every Variable must hold one array"

    groups: list[list[int]] = [[]]
    size = 0
    for i, v in enumerate(variables):
        value = v.get_value()
        nbytes = math.prod(shard_shape(value.shape, shardings[i].spec, mesh)) * value.dtype.itemsize
        if groups[-1] and size + nbytes > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes

    def program(group):
        def create():
            outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts)
            return [outs[i] for i in group]

        return jax.jit(create, out_shardings=[shardings[i] for i in group])

    with jax.set_mesh(mesh):
        with cache_without_collectives() as cached:  # random draws: every device its own shards
            compiled = [program(g).lower().compile() for g in groups]
        if cached and any(runs_collectives(c.as_text()) for c in compiled):  # an init that needs them
            compiled = [program(g).lower().compile() for g in groups]
    return InitProgram(graphdef, treedef, groups, compiled, mesh)


def sharded_init(
    factory: Callable[[], nnx.Module], mesh, rules=None, *, group_bytes: int = INIT_GROUP_BYTES, abstract=None
) -> nnx.Module:
    """Create ``factory()`` directly in its sharded layout: no device ever holds a full tensor.

    The shapes come from ``nnx.eval_shape`` (nothing allocated), the shardings from the
    rules, and creation runs under ``jax.jit`` with those ``out_shardings``, so XLA
    partitions the random number generation itself. Large models are created in groups of
    about ``group_bytes`` per device (see :class:`InitProgram`), which keeps per-device peak
    memory close to the model's shards. ``factory`` is a function of no arguments, e.g.
    ``lambda: GPT2(cfg, rngs=nnx.Rngs(0))``; with JAX's partitionable threefry (the
    default) the values do not depend on the mesh or the grouping. ``abstract``: see
    :func:`compile_init`.
    """
    program = compile_init(factory, mesh, rules, group_bytes=group_bytes, abstract=abstract)
    return nnx.merge(program.graphdef, program.run())


def place(tree, mesh, rules=None):
    """Put a model's arrays onto ``mesh`` in the layout the rules give.

    A Module gives back a new, working Module (graph merged with the placed state); a
    State gives back a State. Arrays already placed on another mesh or under another
    preset are moved device to device: this is also how to *reshard*.
    """
    if isinstance(tree, nnx.Module):
        graphdef, state = nnx.split(tree)
        return nnx.merge(graphdef, place(state, mesh, rules))
    return jax.device_put(tree, state_shardings(tree, mesh, rules))


#: Resharding is placement onto the new mesh/rules; one code path serves both.
reshard = place


def layout_bytes(tree, mesh, rules=None) -> tuple[int, int]:
    """``(bytes per device, bytes unsharded)`` of a model's state under the rules."""
    per_device = full = 0
    for lay in layouts(tree, mesh, rules):
        per_device += shard_bytes(lay.shape, lay.dtype, lay.spec, mesh)
        full += full_bytes(lay.shape, lay.dtype)
    return per_device, full


# --------------------------------------------------------------------------------------
# Lint and the sharding table
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Finding:
    """One lint finding. ``kind`` is a short stable code, ``message`` says what to do."""

    kind: str
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"[{self.kind}] {where}{self.message}"


#: Logical names of activations: a rule for them matches no Variable and is still in use.
ACTIVATION_NAMES = ("batch", "length")


def group_findings(findings) -> list[str]:
    """One line per distinct finding; the same finding on every layer (h.0 ... h.47) once."""
    groups: dict[tuple, list] = {}
    for f in findings:
        key = (f.kind, re.sub(r"\.\d+\.", ".N.", f.path), f.message)
        groups.setdefault(key, []).append(f)
    lines = []
    for (kind, path, message), members in groups.items():
        where = members[0].path if len(members) == 1 else f"{path} ({len(members)} layers)"
        lines.append(f"[{kind}] {where + ': ' if where else ''}{message}")
    return lines


#: Lint kinds a training run prints when it starts: the mesh does not split a tensor the
#: way the rules ask (the run is still correct, but holds more per device than planned).
LAYOUT_FINDINGS = ("indivisible", "axis-reused")


def lint(
    tree, mesh, rules=None, *, replicated_threshold_bytes: int = 1 << 20, activations: Sequence = ()
) -> list[Finding]:
    """Check a (model, rules, mesh) combination before training on it.

    Reports: parameter rules whose logical name is on no Variable, typically a typo
    (``unused-rule``; not the presets' own rules, written for every model: GPT-2 has no
    ``kv_heads``; not a rule none of whose axes this mesh has, such as every preset's
    ``layers`` -> ``stage`` on a mesh without stages: it does nothing here),
    logical names with no rule (``no-rule``), a mesh axis asked for
    twice in one spec (``axis-reused``, naming the dimension that lost it), dimensions
    that do not divide by their shard count (``indivisible``), Variables that used the
    fallback (``unannotated``), and replicated tensors larger than
    ``replicated_threshold_bytes`` on a mesh of more than one device (``replicated``), and
    a ``stage`` axis that splits no Variable, a model without stacked layers
    (``unused-rule``).
    Small parameters kept whole below ``min_shard_bytes`` are by design and not reported.

    ``activations``: :class:`~nnxscale.ActivationRecord` s from tracing the model
    (``record_activations``); each mesh axis an activation asked for and did not get is
    reported as ``activation``.
    """
    resolved = resolve(rules, mesh)
    findings: list[Finding] = []
    names_in_model: set[str] = set()
    n_devices = resolved.num_devices
    stage_used = False
    for lay in layouts(tree, mesh, resolved):
        stage_used = stage_used or any(
            STAGE in entry_axes(e) for e in lay.spec
        )
        for name in lay.logical or (FALLBACK_NAMES.get(len(lay.shape), ()) if lay.is_param else ()):
            names_in_model.update(name if isinstance(name, (tuple, list)) else (name,))
        if lay.fallback and lay.is_param:
            findings.append(
                Finding(
                    "unannotated",
                    lay.path,
                    f"no logical axes: taken as {FALLBACK_NAMES.get(len(lay.shape), 'replicated')}, giving {lay.spec} "
                    "(name its axes with nnxscale.logical)",
                )
            )
        for name in lay.unmatched:
            findings.append(Finding("no-rule", lay.path, f"logical axis {name!r} has no rule and is replicated"))
        for dropped in lay.dropped:
            if dropped.reason == NOT_SPLIT:  # kept whole on purpose (min_shard_bytes)
                continue
            findings.append(Finding(dropped.reason, lay.path, dropped.message))  # REUSED or INDIVISIBLE
        nbytes = full_bytes(lay.shape, lay.dtype)
        if n_devices > 1 and all(e is None for e in lay.spec) and nbytes > replicated_threshold_bytes:
            findings.append(
                Finding(
                    "replicated",
                    lay.path,
                    f"{format_bytes(nbytes)} {lay.shape} is replicated on all {n_devices} devices",
                )
            )
    shipped = {rule for preset in PRESETS.values() for rule in preset.params}
    for name, axes in resolved.rules.params:
        if axes is None or name in names_in_model or name in ACTIVATION_NAMES or (name, axes) in shipped:
            continue  # "replicate" matching nothing is harmless; a preset's rule serves models that have the name
        if not any(a in resolved.sizes for a in entry_axes(axes)):
            continue  # none of its axes is on this mesh: it would replicate anyway
        findings.append(Finding("unused-rule", "", f"rule {name!r} -> {axes!r} matches no Variable of this model"))
    if resolved.sizes.get(STAGE, 1) > 1 and not stage_used:
        findings.append(
            Finding(
                "unused-rule",
                "",
                f"the mesh's stage axis (stage={resolved.sizes['stage']}) splits no Variable: the model has no stacked "
                "layers (nnxscale.stack_layers) for pipeline stages to hold, so each stage holds everything",
            )
        )
    for record in activations:
        where = "activation (" + ", ".join(str(n) for n in record.names) + f") {record.shape}"
        for dropped in record.layout.dropped:
            findings.append(Finding("activation", where, dropped.message))
        for name in record.layout.unmatched:
            findings.append(Finding("no-rule", where, f"logical axis {name!r} has no activation rule and is replicated"))
    return findings


@dataclasses.dataclass(frozen=True)
class ShardingTable:
    """Per-Variable layout rows plus totals; ``str()`` renders an aligned text table."""

    rows: tuple[VariableLayout, ...]
    mesh_sizes: dict
    per_device_bytes: int
    total_bytes: int
    num_params: int

    def __str__(self) -> str:
        header = ("path", "shape", "dtype", "logical", "spec", "shard", "per device")
        lines = [header]
        for r in self.rows:
            logical = "-" if r.logical is None else "(" + ", ".join(str(n) for n in r.logical) + ")"
            spec = "P(" + ", ".join(repr(e) if e is not None else "None" for e in r.spec) + ")"
            lines.append(
                (
                    r.path,
                    str(r.shape),
                    str(r.dtype),
                    logical,
                    spec,
                    str(shard_shape(r.shape, r.spec, self.mesh_sizes)),
                    format_bytes(shard_bytes(r.shape, r.dtype, r.spec, self.mesh_sizes)),
                )
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
        out.insert(1, "  ".join("-" * w for w in widths))
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh_sizes.items())
        ratio = self.total_bytes / max(self.per_device_bytes, 1)
        out.append(
            f"total: {self.num_params:,} parameters, {format_bytes(self.total_bytes)} unsharded, "
            f"{format_bytes(self.per_device_bytes)} per device on mesh {mesh} ({ratio:.1f}x less)"
        )
        return "\n".join(out)


def sharding_table(tree, mesh, rules=None) -> ShardingTable:
    """The human-readable layout of every Variable of a model (abstract models work too)."""
    resolved = resolve(rules, mesh)
    sizes = resolved.sizes
    rows = tuple(layouts(tree, mesh, resolved))
    per_device = sum(shard_bytes(r.shape, r.dtype, r.spec, sizes) for r in rows)
    total = sum(full_bytes(r.shape, r.dtype) for r in rows)
    params = sum(math.prod(r.shape) for r in rows if r.is_param)
    return ShardingTable(rows, sizes, per_device, total, params)

