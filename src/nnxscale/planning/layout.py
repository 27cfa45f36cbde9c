"""A plan's exact arithmetic: the run's layout per device, from an abstract mesh.

The run is built by :func:`nnxscale.training.setup`, the trainer's own, on an abstract mesh
(no devices needed); parameters, optimizer state, gradients and batch per device are the
shard sizes of its abstract state.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
from jax.sharding import AbstractMesh, AxisType

from nnxscale.sharding.axes import EXPERT, entry_axes
from nnxscale.sharding.layout import full_bytes, itemsize
from nnxscale.sharding.mesh import parse_mesh_spec, resolve_mesh_shape
from nnxscale.sharding.state import layouts, path_str
from nnxscale.training.config import TrainConfig
from nnxscale.training.state import setup


def mesh_sizes(spec, devices: Optional[int] = None) -> dict[str, int]:
    """``{axis: size}`` of a mesh spec; ``-1`` takes ``devices`` (default: this job's)."""
    axes = parse_mesh_spec(spec)
    if -1 in axes.values():
        if devices is None:
            devices = jax.device_count()
        return resolve_mesh_shape(axes, devices)
    if devices is not None:
        return resolve_mesh_shape(axes, devices)
    return axes


def layout_figures(cfg: TrainConfig, sizes: dict[str, int], s=None) -> dict[str, Any]:
    """Parameters, optimizer state, gradients and batch per device, from the layout alone.

    The run is built by :func:`nnxscale.training.setup`, the trainer's own, on an abstract
    mesh of ``sizes`` (no devices needed); the figures are the shard sizes of its abstract
    state, the arrays a run would allocate. Also ``model`` (the run's
    :class:`~nnxscale.training.model.RunModel`), ``abstract`` (the model's state, nothing
    allocated), ``rules`` (resolved against ``sizes``) and ``setup`` itself.

    ``s``: the run's setup when the caller has built it already (on devices, to compile it):
    its shard sizes are the same, and its rules are not resolved again.
    """
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))
    if s is None:
        s = setup(cfg, mesh, separator=plan_separator(cfg))
    rows = layouts(s.model_state, sizes, s.rules)

    def per_device(tree) -> int:
        return int(sum(math.prod(a.sharding.shard_shape(a.shape)) * itemsize(a.dtype) for a in jax.tree.leaves(tree)))

    trained = per_device(s.abstract["params"])  # a LoRA run: its adapters; its frozen base has no gradient
    # frozen arrays beside them: a LoRA run's base, --objective dpo's reference parameters
    param_bytes = trained + sum(per_device(s.abstract.get(k, {})) for k in ("base", "reference"))
    return {
        "model": s.model,
        "abstract": s.model_state,
        "rules": s.rules,
        "rows": rows,
        "setup": s,
        "num_params": sum(math.prod(r.shape) for r in rows if r.is_param),
        "full_param_bytes": sum(full_bytes(r.shape, r.dtype) for r in rows),
        "param_bytes": param_bytes,
        "optimizer_bytes": per_device(s.abstract["opt_state"]),
        "gradient_bytes": trained,  # float32, constrained to the parameters' layout
        "batch_bytes": per_device(s.abstract_batch),
        "pipeline": s.pipeline,
        "stacked_layers": s.stacked_layers,
    }


def trained_rows(lay: dict) -> list:
    """The rows of ``lay`` (:func:`layout_figures`) whose parameters the step differentiates:
    under LoRA the adapters alone (the frozen base has no gradient to reduce), else all."""
    rows = lay["rows"]
    if lay["model"].lora is None:
        return rows
    trained = {path_str(path) for path, _ in jax.tree_util.tree_flatten_with_path(lay["setup"].abstract["params"])[0]}
    return [r for r in rows if r.path in trained]


def split_params(rows, rules) -> dict[str, float]:
    """Full bytes of the parameters, by how the batch axes treat them, divided by the
    other (tensor-parallel) axes: ``fsdp`` (split over a batch axis: gathered every step),
    ``replicated`` (whole on every batch shard: its gradient is all-reduced) and ``expert``
    (a mixture's experts split over the expert axis alone: each device keeps its own, never
    gathered; this is one device's share, its gradient all-reduced over the other batch axes).
    Experts split over the expert axis and FSDP's count as FSDP's, one device's experts'
    worth (they are gathered only among the devices holding the same experts);
    ``experts``: whether any parameter is split over the expert axis."""
    batch = {a for a in (*rules.batch_axes, *rules.length_axes) if rules.sizes[a] > 1}  # context: FSDP-like
    out = {"fsdp": 0.0, "replicated": 0.0, "expert": 0.0, "experts": 0.0}
    for row in rows:
        axes = {a for e in row.spec for a in entry_axes(e)}
        share = full_bytes(row.shape, row.dtype) / math.prod(rules.sizes[a] for a in axes - batch)
        if EXPERT in axes & batch:
            share /= rules.sizes[EXPERT]
            out["experts"] += share
            out["expert" if axes & batch == {EXPERT} else "fsdp"] += share
        else:
            out["fsdp" if axes & batch else "replicated"] += share
    return out


def plan_separator(cfg: TrainConfig):
    """A plan's document separator under ``--document-mask``: the plan reads no data, and the
    compiled step is the same program whichever token ends a document (the trainer's
    separator: :func:`nnxscale.training.inputs.document_separator`)."""
    return 0 if cfg.data.document_mask else None

