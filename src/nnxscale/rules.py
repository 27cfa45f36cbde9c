"""Logical axis rules: model code names logical axes, a rules table maps them to mesh axes.

Model code never names a mesh axis. It annotates each Variable with logical names::

    kernel_init = nnxscale.logical(nnx.initializers.lecun_normal(), "embed", "mlp")
    self.up = nnx.Linear(d, 4 * d, kernel_init=kernel_init, rngs=rngs)

A *rules table* is an ordered sequence of ``(logical_name, mesh_axes)`` pairs, where
``mesh_axes`` is a mesh axis name, a tuple of names, or ``None`` (replicate). Resolution of
one logical name on one mesh:

1. Walk the rules in order and take the **first** rule for that logical name whose mesh
   axes, after dropping the axes this mesh does not have, are not empty. ``None`` is an
   explicit "replicate" and also wins.
2. If no rule matches, a logical name that is itself an axis of the mesh maps to that axis
   (so Flax-style ``out_sharding=(None, "model")`` annotations keep working); any other
   name is replicated, and :func:`nnxscale.lint` reports it.

First match wins (MaxText's lesson: with "last wins" or "all match" semantics a later,
broader rule silently drops the axes of an earlier one). Axes a mesh lacks drop out, so
one table serves every mesh: on ``data=8`` the tensor-parallel rules vanish and the table
is pure data parallel; on ``data=2,model=4`` they apply.

Presets (:data:`PRESETS`) are written for the canonical mesh axis names ``data`` (alias
``batch``), ``fsdp``, and ``model`` (alias ``tensor``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional, Union

from flax import nnx
from jax.sharding import PartitionSpec as P

from nnxscale.errors import RulesError
from nnxscale.mesh import mesh_axis_sizes

AxisNames = Union[str, tuple[str, ...], None]
Rules = tuple[tuple[str, AxisNames], ...]

#: Metadata key under which nnxscale stores logical axis names on a Variable.
LOGICAL_KEY = "logical_axes"

#: The logical axis names nnxscale's own models use.
LOGICAL_NAMES = ("batch", "length", "embed", "mlp", "heads", "kv", "vocab")

_BATCH_AXES = ("data", "batch", "fsdp")  # every data-like axis splits the batch
_TENSOR_AXES = ("model", "tensor")

_DP: Rules = (("batch", _BATCH_AXES),)
_FSDP: Rules = (
    ("batch", _BATCH_AXES),
    ("embed", "fsdp"),  # ZeRO-3: each parameter split along its embedding dimension
)
_TP: Rules = (
    ("batch", _BATCH_AXES),
    ("mlp", _TENSOR_AXES),  # Megatron: up-projection column-parallel, down row-parallel
    ("heads", _TENSOR_AXES),  # attention split by heads
    ("vocab", _TENSOR_AXES),  # embedding / output head split by vocabulary
)
_FSDP_TP: Rules = _TP + (("embed", "fsdp"),)

def _complete(rules: Rules) -> Rules:
    """Append an explicit "replicate" rule for each logical name a preset does not shard."""
    named = {name for name, _ in rules}
    return rules + tuple((name, None) for name in LOGICAL_NAMES if name not in named)


#: Named rule presets. ``auto`` is the default: every rule, so the mesh's own axis names
#: decide (``data``/``batch`` split the batch, ``fsdp`` splits parameters and the batch,
#: ``model``/``tensor`` split heads, MLP and vocabulary). Each preset names every logical
#: axis in :data:`LOGICAL_NAMES`; those it does not shard are replicated explicitly.
PRESETS: dict[str, Rules] = {
    "auto": _complete(_FSDP_TP),
    "dp": _complete(_DP),
    "fsdp": _complete(_FSDP),
    "tp": _complete(_TP),
    "fsdp_tp": _complete(_FSDP_TP),
}

PRESET_HELP = {
    "auto": "follow the mesh axis names (default): data/batch split the batch, fsdp splits parameters and batch, model/tensor split heads, MLP and vocabulary",
    "dp": "data parallel: batch split over data, batch and fsdp axes; parameters replicated",
    "fsdp": "fully sharded data parallel: batch split, parameters split along 'embed' over fsdp",
    "tp": "tensor parallel (Megatron column/row): heads, MLP and vocabulary split over model/tensor",
    "fsdp_tp": "FSDP + tensor parallel: both of the above",
}


def logical(initializer, *names: Optional[str]):
    """Wrap an initializer so the Variable it creates carries logical axis names.

    ``logical(init, "embed", "mlp")`` for a ``(embed, mlp)`` kernel; ``None`` for an axis
    that is never sharded. The names are metadata only: nothing is sharded at creation.
    """
    return nnx.with_metadata(initializer, **{LOGICAL_KEY: tuple(names)})


def get_rules(rules: Union[str, Sequence, Mapping, None] = None) -> Rules:
    """Resolve a preset name, a rules spec string, a mapping or a sequence into a table.

    ``None`` -> the ``auto`` preset. A spec string ``"batch=data+fsdp,mlp=model,embed="``
    gives one rule per entry (``+`` joins axes, an empty value replicates).
    """
    if rules is None:
        return PRESETS["auto"]
    if isinstance(rules, str):
        name = rules.strip()
        if name in PRESETS:
            return PRESETS[name]
        if "=" not in name:
            raise RulesError(
                f"unknown rules preset {name!r}: choose one of {', '.join(PRESETS)}, "
                "or write rules as 'batch=data+fsdp,mlp=model'"
            )
        out = []
        for part in name.split(","):
            if part.count("=") != 1:
                raise RulesError(f"malformed rule {part!r}: write logical=axis or logical=axis1+axis2")
            logical_name, axes = (s.strip() for s in part.split("="))
            if not logical_name:
                raise RulesError(f"rule {part!r} has no logical axis name")
            axis_tuple = tuple(a.strip() for a in axes.split("+") if a.strip())
            out.append((logical_name, axis_tuple or None))
        return tuple(out)
    if isinstance(rules, Mapping):
        return tuple((str(k), _norm_axes(v)) for k, v in rules.items())
    return tuple((str(k), _norm_axes(v)) for k, v in rules)


def _norm_axes(v) -> AxisNames:
    if v is None or isinstance(v, str):
        return v
    return tuple(v)


def _rule_axes(axes: AxisNames) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


def resolve_name(name: Optional[str], rules: Rules, mesh) -> tuple[Optional[tuple[str, ...]], Optional[int]]:
    """Mesh axes for one logical name, and the index of the rule that decided it.

    Returns ``(axes, rule_index)``: ``axes`` is ``None`` for replicated; ``rule_index`` is
    ``None`` when no rule decided (identity fallback or unmatched).
    """
    if name is None:
        return None, None
    sizes = mesh_axis_sizes(mesh)
    for i, (logical_name, axes) in enumerate(rules):
        if logical_name != name:
            continue
        if axes is None:
            return None, i
        present = tuple(a for a in _rule_axes(axes) if a in sizes)
        if present:
            return present, i
    if name in sizes:
        return (name,), None
    return None, None


def logical_to_spec(names: Sequence[Optional[str]], rules, mesh) -> P:
    """PartitionSpec for a tensor whose dimensions have logical ``names``.

    A single mesh axis is written as a plain string, several as a tuple, as JAX prints them.
    """
    table = get_rules(rules)
    entries = []
    for name in names:
        axes, _ = resolve_name(name, table, mesh)
        if axes is None:
            entries.append(None)
        elif len(axes) == 1:
            entries.append(axes[0])
        else:
            entries.append(axes)
    return P(*entries)


def batch_spec(rules, mesh, ndim: int = 2) -> P:
    """PartitionSpec of a ``(batch, length, ...)`` input batch under ``rules``."""
    return logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh)


def batch_shard_count(rules, mesh) -> int:
    """How many ways the batch dimension is split (the global batch must be a multiple)."""
    sizes = mesh_axis_sizes(mesh)
    axes, _ = resolve_name("batch", get_rules(rules), mesh)
    count = 1
    for a in axes or ():
        count *= sizes[a]
    return count
