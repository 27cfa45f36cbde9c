"""Logical axis rules: model code names logical axes, rules map them to mesh axes.

Model code never names a mesh axis. It annotates each Variable with logical names::

    kernel_init = nnxscale.logical(nnx.initializers.lecun_normal(), "embed", "mlp")
    self.up = nnx.Linear(d, 4 * d, kernel_init=kernel_init, rngs=rngs)

and constrains its activations the same way (:func:`nnxscale.constrain`)::

    x = nnxscale.constrain(x, "batch", "length", "embed")

A *table* is an ordered sequence of ``(logical_name, mesh_axes)`` pairs, where
``mesh_axes`` is a mesh axis name, a tuple of names, or ``None`` (replicate). Rules
(:class:`AxisRules`) are two tables: one for **parameters** and one for **activations**,
as Levanter separates parameter and compute axis mappings. FSDP is exactly their
difference: parameters are split along ``embed`` over ``fsdp`` while activations are split
along the batch over ``data`` and ``fsdp``, so every device computes on its own rows with
gathered weights.

Resolution of one logical name on one mesh, in either table:

1. Walk the table in order and take the **first** rule for that name whose mesh axes,
   after dropping the axes this mesh does not have, are not empty. ``None`` is an explicit
   "replicate" and also wins.
2. If no rule matches, a logical name that is itself an axis of the mesh maps to that axis
   (so Flax-style ``out_sharding=(None, "model")`` annotations keep working); any other
   name is replicated, and :func:`nnxscale.lint` reports it.

First match wins (MaxText's lesson: with "last wins" or "all match" semantics a later,
broader rule silently drops the axes of an earlier one). Axes a mesh lacks drop out, so
one table serves every mesh: on ``data=8`` the tensor-parallel rules vanish; on
``data=2,model=4`` they apply.

A resolved spec is always valid (:func:`layout_for`): a mesh axis that an earlier
dimension already uses, or whose size does not divide the dimension, is dropped for that
dimension, and the reason is kept for the lint. Parameters smaller than
``min_shard_bytes`` (default :data:`MIN_SHARD_BYTES`, 1 MiB) are not split over the FSDP
axes (the mesh axes that also split the batch): gathering a 768-wide LayerNorm scale from
eight devices costs more than keeping it (big_vision's ``min_size_to_shard_mb``, there 4 MiB).

Rules are resolved against a mesh once, into a :class:`MeshRules` that answers
parameter and activation specs alike (:func:`resolve`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Optional, Union

from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.errors import RulesError
from nnxscale.sharding.axes import BATCH_AXES, CONTEXT, EXPERT, STAGE, entry_axes
from nnxscale.sharding.layout import itemsize
from nnxscale.sharding.mesh import TENSOR_PARALLEL_AXES, mesh_axis_sizes

AxisNames = Union[str, tuple[str, ...], None]
Table = tuple[tuple[str, AxisNames], ...]

#: Metadata key under which nnxscale stores logical axis names on a Variable.
LOGICAL_KEY = "logical_axes"

#: The logical axis names nnxscale's own models use. ``layers`` is the leading axis of
#: stacked (scanned) layers (``outer_layers`` of a stack a pipeline leaves whole); ``length`` the sequence; ``kv`` the width of one attention
#: head; ``kv_heads`` the key/value heads of grouped-query attention (Llama), fewer than
#: the query ``heads``; ``expert`` the experts of a mixture (:mod:`nnxscale.layers.moe`).
LOGICAL_NAMES = ("batch", "length", "layers", "outer_layers", "embed", "mlp", "heads", "kv_heads", "kv", "vocab", "expert")

#: Parameters smaller than this are not split over FSDP axes (see the module docstring).
MIN_SHARD_BYTES = 1 << 20

_BATCH_AXES = BATCH_AXES  # every data-like axis splits the batch
_TENSOR_AXES = TENSOR_PARALLEL_AXES

_BATCH: Table = (("batch", _BATCH_AXES),)
_TENSOR: Table = (
    ("mlp", _TENSOR_AXES),  # Megatron: up-projection column-parallel, down row-parallel
    ("heads", _TENSOR_AXES),  # attention split by heads
    ("kv_heads", _TENSOR_AXES),  # grouped-query K/V heads: split with their query heads, or replicated if too few
    ("vocab", _TENSOR_AXES),  # embedding / output head split by vocabulary
)
# ZeRO-3: parameters split along their embedding, over fsdp and over the context axis (whose
# devices hold different tokens of the same rows: as MaxText, they share the weights' memory too)
_FSDP_PARAMS: Table = (("embed", ("fsdp", CONTEXT)),)
_STAGES: Table = (("layers", STAGE), ("expert", EXPERT))  # pipeline stages hold their own stacked layers, expert devices their own experts
_CONTEXT: Table = (("length", CONTEXT),)  # context parallelism: activations split along the sequence


def _norm_axes(v) -> AxisNames:
    if v is None or isinstance(v, str):
        return v
    v = tuple(v)
    return v if v else None


def _complete(table: Table) -> Table:
    """Append an explicit "replicate" rule for each logical name a table does not shard."""
    named = {name for name, _ in table}
    return table + tuple((name, None) for name in LOGICAL_NAMES if name not in named)


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Rules for parameters and for activations: two tables of ``(logical, mesh axes)``."""

    params: Table
    activations: Table

    def __post_init__(self):
        for which in ("params", "activations"):
            table = getattr(self, which)
            object.__setattr__(self, which, tuple((str(n), _norm_axes(a)) for n, a in table))

    def __str__(self) -> str:
        def text(table):
            return ",".join(f"{n}={'+'.join(entry_axes(a))}" for n, a in table)

        if self.params == self.activations:
            return text(self.params)
        return f"params: {text(self.params)}; activations: {text(self.activations)}"


def _preset(params: Table, activations: Table) -> AxisRules:
    return AxisRules(_complete(params), _complete(activations))


#: Named rule presets. ``auto`` is the default: every rule, so the mesh's own axis names
#: decide (``data``/``batch`` split the batch, ``fsdp`` splits parameters and the batch,
#: ``model``/``tensor`` split heads, MLP and vocabulary for parameters and activations).
#: Each preset names every logical axis in :data:`LOGICAL_NAMES` in both tables; those it
#: does not shard are replicated explicitly. On a mesh with a ``stage`` axis every preset
#: splits stacked layers (``layers``) over it, so each pipeline stage holds only its own; on
#: one with a ``context`` axis every preset splits the activations' ``length`` over it (the
#: FSDP presets also split the parameters over it); on one with an ``expert`` axis every
#: preset splits a mixture's experts over it (and the batch, as a data axis).
PRESETS: dict[str, AxisRules] = {
    "auto": _preset(_BATCH + _TENSOR + _FSDP_PARAMS + _STAGES, _BATCH + _CONTEXT + _TENSOR),
    "dp": _preset(_BATCH + _STAGES, _BATCH + _CONTEXT),
    "fsdp": _preset(_BATCH + _FSDP_PARAMS + _STAGES, _BATCH + _CONTEXT),
    "tp": _preset(_BATCH + _TENSOR + _STAGES, _BATCH + _CONTEXT + _TENSOR),
    "fsdp_tp": _preset(_BATCH + _TENSOR + _FSDP_PARAMS + _STAGES, _BATCH + _CONTEXT + _TENSOR),
}

PRESET_HELP = {
    "auto": "follow the mesh axis names (default): data/batch split the batch, fsdp splits parameters and batch, model/tensor split heads, MLP and vocabulary, context splits the sequence (and parameters, like fsdp)",
    "dp": "data parallel: batch split over data, batch and fsdp axes; parameters replicated",
    "fsdp": "fully sharded data parallel: batch split, parameters split along 'embed' over fsdp (and context)",
    "tp": "tensor parallel (Megatron column/row): heads, MLP and vocabulary split over model/tensor",
    "fsdp_tp": "FSDP + tensor parallel: both of the above",
}

_PREFIXES = {"param.": "params", "act.": "activations"}


def logical(initializer, *names: Optional[str], **metadata):
    """Wrap an initializer so the Variable it creates carries logical axis names.

    ``logical(init, "embed", "mlp")`` for a ``(embed, mlp)`` kernel; ``None`` for an axis
    that is never sharded. The names are metadata only: nothing is sharded at creation.
    Other ``metadata`` goes on the Variable too, e.g. ``weight_decay=False`` (the trainer's
    decay mask reads it).
    """
    return nnx.with_metadata(initializer, **metadata, **{LOGICAL_KEY: tuple(names)})


def get_rules(rules: Union[str, Sequence, Mapping, AxisRules, "MeshRules", None] = None) -> AxisRules:
    """Resolve a preset name, a rules string, a table or a mapping into :class:`AxisRules`.

    - ``None``: the ``auto`` preset; a preset name: that preset.
    - A rules string, entries separated by commas: ``logical=axis1+axis2`` (an empty value
      replicates) applies to parameters and activations; ``param.logical=...`` or
      ``act.logical=...`` to one of them; a preset name includes that preset's rules
      *after* the written ones (first match wins, so written rules override it). E.g.
      ``"batch=data,mlp=model,param.embed=fsdp"`` or ``"layers=stage,fsdp"``.
    - A mapping ``{logical: axes}`` or a sequence of pairs: one table for both.
    """
    if rules is None:
        return PRESETS["auto"]
    if isinstance(rules, AxisRules):
        return rules
    if isinstance(rules, MeshRules):
        return rules.rules
    if isinstance(rules, str):
        return _parse_rules(rules)
    if isinstance(rules, Mapping):
        table = tuple((str(k), _norm_axes(v)) for k, v in rules.items())
    else:
        table = tuple((str(k), _norm_axes(v)) for k, v in rules)
    return AxisRules(table, table)


def _parse_rules(text: str) -> AxisRules:
    name = text.strip()
    if name in PRESETS:
        return PRESETS[name]
    if "=" not in name:
        raise RulesError(
            f"unknown rules preset {name!r}: choose one of {', '.join(PRESETS)}, "
            "or write rules as 'batch=data+fsdp,mlp=model'"
        )
    written: dict[str, list] = {"params": [], "activations": []}
    included: list[AxisRules] = []
    for part in name.split(","):
        part = part.strip()
        if part in PRESETS:
            included.append(PRESETS[part])
            continue
        if part.count("=") != 1:
            raise RulesError(
                f"malformed rule {part!r} in {text!r}: write logical=axis or logical=axis1+axis2 "
                f"(param.NAME / act.NAME for one table), or a preset name ({', '.join(PRESETS)})"
            )
        logical_name, axes = (s.strip() for s in part.split("="))
        which = ("params", "activations")
        for prefix, table in _PREFIXES.items():
            if logical_name.startswith(prefix):
                logical_name, which = logical_name.removeprefix(prefix), (table,)
        if not logical_name:
            raise RulesError(f"rule {part!r} in {text!r} has no logical axis name")
        axis_tuple = tuple(a.strip() for a in axes.split("+") if a.strip())
        for table in which:
            written[table].append((logical_name, axis_tuple or None))
    params = tuple(written["params"]) + sum((p.params for p in included), ())
    activations = tuple(written["activations"]) + sum((p.activations for p in included), ())
    return AxisRules(params, activations)


def resolve_name(name: Optional[str], table: Table, sizes: Mapping[str, int]) -> tuple[Optional[tuple[str, ...]], bool]:
    """Mesh axes for one logical name (``None``: replicated) and whether the table knows it.

    Axes the mesh lacks are dropped; the first rule with axes left (or an explicit
    ``None``) wins; a name no rule mentions maps to the mesh axis of that name, if any.
    The flag is ``False`` for a name no rule mentions and that is no mesh axis.
    """
    if name is None:
        return None, True
    mentioned = False
    for logical_name, axes in table:
        if logical_name != name:
            continue
        mentioned = True
        if axes is None:
            return None, True
        present = tuple(a for a in entry_axes(axes) if a in sizes)
        if present:
            return present, True
    if not mentioned and name in sizes:
        return (name,), True
    return None, mentioned


#: Why a dimension did not get a mesh axis it asked for (:attr:`DroppedAxis.reason`).
REUSED = "axis-reused"  # an earlier dimension of the tensor already uses the axis
INDIVISIBLE = "indivisible"  # the dimension's size does not divide by the axes' product
NOT_SPLIT = "not-split"  # the axis is one the tensor is kept whole on (e.g. FSDP, below min_shard_bytes)


@dataclasses.dataclass(frozen=True)
class DroppedAxis:
    """A mesh axis that dimension ``dim`` (logical ``name``) asked for and did not get, and why.

    ``reason`` is :data:`REUSED`, :data:`INDIVISIBLE` or :data:`NOT_SPLIT`; ``message`` says
    it in words (``str()`` of it, and ``"text" in dropped`` reads the message).
    """

    dim: int
    name: object
    axis: str
    reason: str
    message: str

    def __str__(self) -> str:
        return self.message

    def __contains__(self, text: str) -> bool:
        return text in self.message


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How one tensor's logical names became a PartitionSpec, with the reasons.

    ``dropped``: one :class:`DroppedAxis` per mesh axis a dimension asked for but did not get
    (already used by an earlier dimension, not dividing the size, or an FSDP split of a small
    parameter); ``unmatched``: logical names no rule mentions (replicated).
    """

    spec: P
    dropped: tuple[DroppedAxis, ...] = ()
    unmatched: tuple[str, ...] = ()


def layout_for(
    names: Sequence,
    shape: Optional[Sequence[int]],
    table: Table,
    sizes: Mapping[str, int],
    *,
    no_split: Sequence[str] = (),
    no_split_reason: str = "",
) -> TensorLayout:
    """The PartitionSpec for a tensor whose dimensions have logical ``names``.

    Always valid: each mesh axis shards at most one dimension (the first that asks for it),
    and with ``shape`` only axes whose product divides the dimension are kept. Axes in
    ``no_split`` are never used (the FSDP axes for a small parameter). A dimension's name
    may be a tuple of names (Flax style), sharding it over all of their axes.
    """
    if shape is not None and len(names) != len(shape):
        raise RulesError(f"logical axes {tuple(names)} ({len(names)} names) do not match shape {tuple(shape)} (rank {len(shape)})")
    used: set[str] = set()
    entries, dropped, unmatched = [], [], []
    for dim, name in enumerate(names):
        parts = tuple(name) if isinstance(name, (tuple, list)) else (name,)
        axes: list[str] = []
        for part in parts:
            part_axes, decided = resolve_name(part, table, sizes)
            if not decided:
                unmatched.append(part)
            axes.extend(part_axes or ())
        kept: list[str] = []
        for a in axes:
            if a in used or a in kept:
                message = f"dim {dim} ({name}): mesh axis {a!r} already shards another dimension"
                dropped.append(DroppedAxis(dim, name, a, REUSED, message))
                continue
            if a in no_split:
                message = f"dim {dim} ({name}): not split over {a!r}: {no_split_reason}"
                dropped.append(DroppedAxis(dim, name, a, NOT_SPLIT, message))
                continue
            count = math.prod(sizes[k] for k in kept) * sizes[a]
            if shape is not None and shape[dim] % count:
                message = (f"dim {dim} ({name}={shape[dim]}) is not divisible by {count} "
                           f"(mesh axes {tuple(kept) + (a,)}): not sharded over {a!r}")  # fmt: skip
                dropped.append(DroppedAxis(dim, name, a, INDIVISIBLE, message))
                continue
            kept.append(a)
        used.update(kept)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return TensorLayout(P(*entries), tuple(dropped), tuple(unmatched))


class MeshRules:
    """Rules resolved against one mesh: the single object every layout question goes to.

    ``mesh`` is a ``jax.sharding.Mesh``, or a plain ``{axis: size}`` mapping for planning
    (then :meth:`sharding` is unavailable). Build it with :func:`resolve`.
    """

    def __init__(self, rules=None, mesh=None, *, min_shard_bytes: int = MIN_SHARD_BYTES):
        if mesh is None:
            raise RulesError("MeshRules needs a mesh (a jax.sharding.Mesh or an {axis: size} mapping)")
        if isinstance(min_shard_bytes, bool) or not isinstance(min_shard_bytes, int) or min_shard_bytes < 0:
            raise RulesError(f"min_shard_bytes must be a non-negative integer, got {min_shard_bytes!r}")
        self.rules = get_rules(rules)
        self.mesh = mesh
        self.sizes = mesh_axis_sizes(mesh)
        self.min_shard_bytes = min_shard_bytes
        self.num_devices = math.prod(self.sizes.values())
        axes, _ = resolve_name("batch", self.rules.activations, self.sizes)
        #: Mesh axes that split the batch; parameters split over them are FSDP-sharded.
        self.batch_axes: tuple[str, ...] = tuple(axes or ())
        self.batch_shard_count = math.prod(self.sizes[a] for a in self.batch_axes)
        length, _ = resolve_name("length", self.rules.activations, self.sizes)
        #: Mesh axes that split the sequence of the activations (context parallelism).
        self.length_axes: tuple[str, ...] = tuple(length or ())
        self.length_shard_count = math.prod(self.sizes[a] for a in self.length_axes)

    def __repr__(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.sizes.items())
        return f"MeshRules({self.rules}, mesh {mesh}, min_shard_bytes={self.min_shard_bytes})"

    def param_layout(self, names: Sequence, shape: Sequence[int], dtype="float32") -> TensorLayout:
        """Layout of a parameter; small ones are not split over the FSDP (batch) axes."""
        small = math.prod(int(d) for d in shape) * itemsize(dtype) < self.min_shard_bytes
        return layout_for(
            names, shape, self.rules.params, self.sizes,
            no_split=self.batch_axes + self.length_axes if small else (),
            no_split_reason=f"smaller than min_shard_bytes={self.min_shard_bytes}, kept whole",
        )  # fmt: skip

    def activation_layout(self, names: Sequence, shape: Optional[Sequence[int]] = None) -> TensorLayout:
        """Layout of an activation (a ``constrain``-ed value) of ``shape``."""
        return layout_for(names, shape, self.rules.activations, self.sizes)

    def param_spec(self, names: Sequence, shape: Sequence[int], dtype="float32") -> P:
        return self.param_layout(names, shape, dtype).spec

    def activation_spec(self, names: Sequence, shape: Optional[Sequence[int]] = None) -> P:
        return self.activation_layout(names, shape).spec

    def activation_split(self, name: str, size: int) -> int:
        """How many ways the activation rules split the logical axis ``name`` of ``size``."""
        return math.prod(self.sizes[a] for e in self.activation_spec((name,), (size,)) for a in entry_axes(e))

    def batch_spec(self, ndim: int = 2) -> P:
        """PartitionSpec of a ``(batch, length, ...)`` input batch (the length split too on a
        ``context`` axis)."""
        return self.activation_spec(("batch", "length")[:ndim] + (None,) * (ndim - 2))

    def sharding(self, spec: P) -> NamedSharding:
        if isinstance(self.mesh, Mapping):
            raise RulesError("these rules were resolved against a mesh shape, not a Mesh: no shardings")
        return NamedSharding(self.mesh, spec)

    def describe(self) -> list[str]:
        """One line per logical name: its parameter and activation mesh axes on this mesh."""
        names = list(dict.fromkeys([n for n, _ in self.rules.params] + [n for n, _ in self.rules.activations]))
        lines = []
        for name in names:
            p, _ = resolve_name(name, self.rules.params, self.sizes)
            a, _ = resolve_name(name, self.rules.activations, self.sizes)
            lines.append(f"{name}: params {'+'.join(p) if p else '-'}, activations {'+'.join(a) if a else '-'}")
        return lines


def resolve(rules=None, mesh=None, *, min_shard_bytes: Optional[int] = None) -> MeshRules:
    """Rules (a preset name, a string, a table, :class:`AxisRules`) against ``mesh``, once.

    A :class:`MeshRules` is returned as it is when neither ``mesh`` nor
    ``min_shard_bytes`` asks for something else (a mesh given as its ``{axis: size}`` shape
    asks for nothing else when the shape is the rules' own); given another mesh, its rules
    and ``min_shard_bytes`` are resolved against that mesh. A run resolves its rules once,
    in :func:`nnxscale.training.setup`, and passes the result on.
    """
    if isinstance(rules, MeshRules):
        if min_shard_bytes is None:
            min_shard_bytes = rules.min_shard_bytes
        same = mesh is None or mesh is rules.mesh or (isinstance(mesh, Mapping) and list(mesh_axis_sizes(mesh).items()) == list(rules.sizes.items()))
        if same and min_shard_bytes == rules.min_shard_bytes:
            return rules
        mesh = rules.mesh if mesh is None else mesh
    if mesh is None:
        raise RulesError("resolve(rules, mesh): give the mesh the rules are for")
    return MeshRules(rules, mesh, min_shard_bytes=MIN_SHARD_BYTES if min_shard_bytes is None else min_shard_bytes)


def logical_to_spec(names: Sequence[Optional[str]], rules, mesh, *, shape=None, kind: str = "params") -> P:
    """PartitionSpec for a tensor whose dimensions have logical ``names``.

    ``kind`` picks the table: ``"params"`` or ``"activations"``. A single mesh axis is
    written as a plain string, several as a tuple, as JAX prints them. The spec is always
    valid (see :func:`layout_for`); with ``shape`` it also divides evenly.
    """
    if kind not in ("params", "activations"):
        raise RulesError(f"kind must be 'params' or 'activations', got {kind!r}")
    table = getattr(get_rules(rules), kind)
    return layout_for(names, shape, table, mesh_axis_sizes(mesh)).spec


def batch_spec(rules, mesh, ndim: int = 2) -> P:
    """PartitionSpec of a ``(batch, length, ...)`` input batch under ``rules``."""
    return resolve(rules, mesh, min_shard_bytes=0).batch_spec(ndim)


def batch_shard_count(rules, mesh) -> int:
    """How many ways the batch dimension is split (the global batch must be a multiple)."""
    return resolve(rules, mesh, min_shard_bytes=0).batch_shard_count
