"""Pipeline parallelism: stacked layers run as stages over a ``stage`` mesh axis.

Model code does not change. A model runs its stacked blocks with
:func:`nnxscale.scan_layers`; while :func:`use_pipeline` is in force (entered around the
traced step, like :func:`nnxscale.use_rules`) that call pipelines them instead::

    pipe = Pipeline.for_mesh(mesh, microbatches=8, repeats=2)   # mesh stage=2,data=4
    with nnxscale.use_rules(rules), use_pipeline(pipe):
        loss = loss_fn(model, batch)

Every rules preset splits the stacked layers' ``layers`` axis over ``stage``, so a device
holds only its stage's layers; their other axes keep their data/FSDP/tensor layout.

**Schedules.** The batch ``(B, ...)`` becomes ``M`` microbatches of ``B/M`` rows
(microbatch ``m`` is rows ``m, m+M, ...``, spread over every batch shard, as gradient
accumulation splits it). One ``jax.shard_map``, manual over ``stage``, runs a
``jax.lax.scan`` of ``R*M + S - 1`` iterations; in each, every stage runs one group of
its layers on one microbatch and hands the result on with one ``ppermute``. The scan
compiles one iteration, so compile time does not grow with depth or microbatches.

- GPipe (``repeats=1``): stage ``s`` holds layers ``[s*L/S, (s+1)*L/S)``; the bubble
  (the idle share of a stage's iterations) is ``(S-1)/(M+S-1)``.
- Circular (``repeats=R``): the layers form ``S*R`` groups; stage ``s`` holds groups
  ``s, s+S, ...``, every microbatch goes round the ring of stages ``R`` times, and stage 0
  keeps returning microbatches in a buffer until their next round (so ``M >= S``). The
  bubble is ``(S-1)/(R*M+S-1)`` (MaxText's formula), for ``R`` times the permutes.

**Layout and checkpoints.** Parameters are created, saved and run unpipelined stacked in
*layer order*, and ``P("stage")`` gives each stage a contiguous block: GPipe's assignment,
so GPipe costs nothing. The circular stage ``s`` needs groups ``s, s+S, ...``, which no
sharding of a layer-ordered axis gives. Regrouping inside every step would move half of
each stage's layers (``R=2``) forward and their gradients backward, every step: 85 MB
each way per device for gpt2 on ``stage=2,data=4``. MaxText stores circular weights as
``(repeats, stages, layers, ...)``, so its checkpoints change shape with the pipeline.
Here the circular schedule runs on *stage order* instead, a fixed permutation of the
stacked layers (:meth:`Pipeline.layer_order`) that only a training run's state holds:

- :func:`to_stage_order` moves a state (parameters and optimizer moments alike: every
  leaf laid out over ``stage`` on its leading axis) into stage order once, after init or
  restore; :func:`to_layer_order` moves it back for each save or export. Each is one
  program of collective-permutes over the stage axis (:func:`stage_order_bytes`):
  for gpt2 on ``stage=2,data=4``, ``R=2``, measured 85 MB sent per device for the
  parameters (170 MB per device of stacked layers), so 255 MB with Adam's two moments,
  once per restore and once per save instead of 170 MB every step. For GPipe both are
  the identity, at no cost.
- What is saved is therefore always layer order: a checkpoint moves between ``data=8``
  and ``stage=2,data=4`` in either direction, and the same seed gives the same
  parameters on every mesh (they are created in layer order).
- The contract: a state in stage order is run only under :func:`use_pipeline` with the
  same stages and repeats; anything else (sampling, export, an unpipelined eval) takes
  :func:`to_layer_order` first.

**Beside the stage axis.** Batch axes that split no stacked parameter (``data``) are
manual inside the pipeline too: a stage's gradients are summed over them once per step,
where the partitioner would all-reduce them after every iteration (``R*M + S - 1`` times
the traffic). FSDP axes stay automatic: every iteration gathers its group's weights and
reduce-scatters their gradients, so a step gathers each of the stage's layers
``(R*M + S - 1)/R`` times where unpipelined FSDP gathers it once: prefer ``data`` beside
``stage``. Tensor-parallel axes are unchanged (their all-reduces run per microbatch).

**A mixture of experts.** The ``expert`` axis, which splits a mixture's experts and the
batch, is manual inside the pipeline too (:func:`manual_axes`): every device keeps its
share of its stage's experts, and each microbatch's tokens go to them and back with
``all_to_all`` within the stage (:mod:`nnxscale.layers.moe`); nothing of the experts is
gathered. Layers that return statistics of their tokens (``aux``: a router's fraction
of tokens per expert, its mean probabilities) have them averaged over the microbatches
and the batch shards, which for means over equal parts is the whole batch's: the
load-balancing loss and the logged load are those of an unpipelined step.

**Outside the pipeline.** The embedding and the head run replicated over the stage axis:
every stage computes them on the device's whole batch, and two all-reduces over
``stage`` move that batch's activations, the pipeline's output to every stage (forward)
and the input's gradient (backward): :attr:`PipelineCost.boundary_bytes`. Every stage
also holds the batch's activations as the microbatch buffer.

**Remat.** The policy (:data:`~nnxscale.layers.stack.REMAT_POLICIES`) applies to every layer
inside the stage, as in :func:`~nnxscale.scan_layers`. A circular stage picks its
repeat's layers inside the layer's rematerialized body, so the backward pass reads them
from the stack again; kept, every iteration would store a copy of its group's weights.

**Dropout.** Layer ``l`` on microbatch ``m`` in batch shard ``j`` of the ``J`` manual
batch shards draws from ``jax.random.fold_in(keys[l], m*J + j)``. The masks differ from
the unpipelined ones (one draw for the whole batch) and depend on ``M`` and the data
axis size; their distribution is the same. Without dropout the pipelined step equals the
unpipelined one to float tolerance: in the tests (float32) outputs are bitwise equal and
gradients agree to 4e-7 relative, the summation order of the microbatches' gradients.

**For the planner.** :func:`pipeline_cost` gives the bubble, the iterations and, per
device and step, the ``collective-permute`` bytes (one microbatch of activations per
iteration, forward and backward) and the boundary bytes; the tests compare them with
the compiled programs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnxscale.errors import ConfigError
from nnxscale.layers import attention
from nnxscale.layers.stack import Rows, is_pipelined, layers_run_by, num_layers, scan_state
from nnxscale.sharding.activations import current_rules
from nnxscale.sharding.axes import EXPERT, STAGE, entry_axes
from nnxscale.sharding.layout import itemsize
from nnxscale.sharding.mesh import context_mesh, format_mesh, mesh_axis_sizes, vary
from nnxscale.sharding.rules import LOGICAL_NAMES, resolve_name
from nnxscale.sharding.state import state_specs


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle share of a stage's iterations: ``(S - 1) / (R * M + S - 1)`` (MaxText's formula).

    GPipe is ``repeats=1``: ``(S - 1) / (M + S - 1)``.
    """
    return (stages - 1) / (repeats * microbatches + stages - 1)


#: The schedules a training step can run: ``gpipe`` (GPipe, or circular with ``repeats > 1``:
#: a forward scan that JAX differentiates) and ``1f1b`` (:mod:`nnxscale.layers.one_f_one_b`:
#: memory independent of the microbatches).
SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A pipeline schedule: ``microbatches`` flow through ``stages`` stages, ``repeats`` times.

    ``repeats=1`` is GPipe: stage ``s`` holds layers ``[s*L/S, (s+1)*L/S)`` and a step
    takes ``M + S - 1`` iterations. ``repeats=R > 1`` is the circular (interleaved)
    schedule: the layers form ``S*R`` groups of ``L/(S*R)``, stage ``s`` holds groups
    ``s, s+S, ..., s+(R-1)*S`` and every microbatch passes the ring of stages ``R`` times,
    in ``R*M + S - 1`` iterations. ``axis`` is the mesh axis whose size is ``stages``.

    Validated at construction (positive sizes, at least as many microbatches as stages);
    :meth:`check` validates it against a model depth and a batch.
    """

    stages: int
    microbatches: int
    repeats: int = 1
    axis: str = STAGE
    one_f_one_b: bool = False  # the training step runs the 1F1B schedule (nnxscale.layers.one_f_one_b)

    def __post_init__(self):
        for name in ("stages", "microbatches", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"pipeline {name} must be a positive integer, got {value!r}")
        if self.one_f_one_b and self.repeats > 1 and self.microbatches % self.stages:
            raise ConfigError(
                f"interleaved 1F1B (--pipeline-schedule 1f1b --pipeline-repeats {self.repeats}) runs the microbatches "
                f"in blocks of one per stage, and {self.microbatches} microbatches are not a multiple of the "
                f"{self.stages} stages: use --microbatches {self.stages * -(-self.microbatches // self.stages)}"
            )
        if not isinstance(self.axis, str) or not self.axis:
            raise ConfigError(f"pipeline axis must be a mesh axis name, got {self.axis!r}")
        if self.microbatches < self.stages:
            raise ConfigError(
                f"{self.microbatches} microbatches cannot fill a pipeline of {self.stages} stages: each stage "
                f"works on its own microbatch, so use at least {self.stages} microbatches"
            )

    @classmethod
    def for_mesh(cls, mesh, microbatches: int, repeats: int = 1, axis: str = STAGE, schedule: str = "gpipe") -> "Pipeline":
        """The pipeline over ``mesh``'s ``axis`` (a ``Mesh`` or an ``{axis: size}`` mapping);
        ``schedule``: one of :data:`SCHEDULES`."""
        if schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
        sizes = mesh_axis_sizes(mesh)
        if axis not in sizes:
            raise ConfigError(
                f"microbatches={microbatches} asks for a pipeline, but mesh {format_mesh(sizes)} has no {axis!r} axis "
                f"to put its stages on: add one (e.g. {axis}=2,data=4), or leave microbatches unset"
            )
        return cls(stages=sizes[axis], microbatches=microbatches, repeats=repeats, axis=axis,
                   one_f_one_b=schedule == "1f1b")  # fmt: skip

    @property
    def schedule(self) -> str:
        """``"gpipe"``, ``"circular"`` or ``"1f1b"``."""
        if self.one_f_one_b:
            return "1f1b"
        return "gpipe" if self.repeats == 1 else "circular"

    @property
    def iterations(self) -> int:
        """Iterations of one forward pass: ``R*M + S - 1``."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """:func:`bubble_fraction` of this schedule."""
        return bubble_fraction(self.stages, self.microbatches, self.repeats)

    def check(self, n_layers: int, batch_size: Optional[int] = None, batch_shards: int = 1) -> None:
        """Raise :class:`~nnxscale.errors.ConfigError` unless ``n_layers`` and the batch fit.

        ``batch_size`` is the global batch, split ``batch_shards`` ways (the data and FSDP
        axes); every shard's rows must split into the microbatches.
        """
        groups = self.stages * self.repeats
        shape = f"{self.stages} stages x {self.repeats} repeats"
        if n_layers < groups:
            raise ConfigError(
                f"a model of {n_layers} layers is too shallow for a pipeline of {shape}: every stage needs at "
                f"least one layer per repeat, {groups} layers in all; use fewer stages or repeats"
            )
        if n_layers % groups:
            fits = [d for d in range(1, n_layers + 1) if n_layers % d == 0]
            raise ConfigError(
                f"{n_layers} layers do not divide into {shape} = {groups} equal groups: choose stages x repeats "
                f"among the divisors of {n_layers} ({', '.join(map(str, fits))})"
            )
        if batch_size is None:
            return
        if batch_size % batch_shards:
            raise ConfigError(f"batch size {batch_size} does not split into {batch_shards} batch shards")
        rows = batch_size // batch_shards
        if rows % self.microbatches:
            raise ConfigError(
                f"{self.microbatches} microbatches do not divide the {rows} rows each batch shard holds (batch "
                f"{batch_size} split {batch_shards} ways): use a batch size that is a multiple of "
                f"{batch_shards * self.microbatches}, or a number of microbatches dividing {rows}"
            )

    def layer_order(self, n_layers: int) -> np.ndarray:
        """The stage order of ``n_layers`` stacked layers: entry ``i`` is the layer stored at ``i``.

        Stage ``s`` holds the ``i`` in ``[s*L/S, (s+1)*L/S)``, its groups ``s, s+S, ...``
        interleaved: ``s*L/S + j*R + r`` holds layer ``j`` of group ``r*S + s``, so that
        the stage's layers reshape to ``(L/(S*R), R, ...)`` without a copy. The identity
        for GPipe.
        """
        self.check(n_layers)
        R, S = self.repeats, self.stages
        return np.arange(n_layers).reshape(R, S, n_layers // (R * S)).transpose(1, 2, 0).reshape(-1)


# --------------------------------------------------------------------------------------
# The pipeline in force
# --------------------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar("nnxscale_pipeline", default=None)


@contextlib.contextmanager
def use_pipeline(pipeline: Optional[Pipeline], mesh=None):
    """Within the block, :func:`~nnxscale.layers.stack.scan_layers` runs stacked layers through ``pipeline``.

    ``mesh`` is the mesh whose ``pipeline.axis`` holds the stages; by default the mesh of
    the rules in force (:func:`nnxscale.use_rules`) or the one set with ``jax.set_mesh``.
    Like ``use_rules`` it must be active while a function is *traced*. ``None`` is no
    pipeline (so a caller can always enter it). Yields ``pipeline``.
    """
    if pipeline is not None and not isinstance(pipeline, Pipeline):
        raise ConfigError(f"use_pipeline takes a Pipeline or None, got {type(pipeline).__name__}")
    token = _ACTIVE.set(None if pipeline is None else (pipeline, mesh))
    runner = None if pipeline is None else functools.partial(pipeline_layers, pipeline=pipeline, mesh=mesh)
    try:
        with layers_run_by(runner):
            yield pipeline
    finally:
        _ACTIVE.reset(token)


def current_pipeline() -> Optional[Pipeline]:
    """The pipeline :func:`use_pipeline` put in force here, or ``None``."""
    active = _ACTIVE.get()
    return None if active is None else active[0]


@contextlib.contextmanager
def without_pipeline():
    """Within the block no pipeline is in force (:func:`current_pipeline` is ``None``), whatever
    :func:`use_pipeline` encloses it; who runs :func:`~nnxscale.scan_layers` is left as it is.
    A schedule enters it around its stages: layers that scan stacks of their own run them unpipelined."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def mesh_for(pipeline: Pipeline, mesh):
    """The mesh to run ``pipeline`` on: given, else the rules' mesh, else the one set with ``jax.set_mesh``."""
    if mesh is None:
        rules = current_rules()
        if rules is not None and isinstance(rules.mesh, jax.sharding.Mesh):
            mesh = rules.mesh
    if mesh is None:
        context = jax.sharding.get_abstract_mesh()
        mesh = None if context.empty else context
    if mesh is None:
        raise ConfigError(
            "a pipeline needs a mesh: pass mesh=, or enter nnxscale.use_rules(rules, mesh) or jax.set_mesh(mesh)"
        )
    sizes = mesh_axis_sizes(mesh)
    if sizes.get(pipeline.axis) != pipeline.stages:
        raise ConfigError(
            f"a pipeline of {pipeline.stages} stages runs on a mesh axis {pipeline.axis}={pipeline.stages}, "
            f"and mesh {format_mesh(sizes)} has "
            + (f"{pipeline.axis}={sizes[pipeline.axis]}" if pipeline.axis in sizes else f"no {pipeline.axis!r} axis")
            + ": build the Pipeline from this mesh (Pipeline.for_mesh)"
        )
    return mesh


# --------------------------------------------------------------------------------------
# The schedule
# --------------------------------------------------------------------------------------


def pipeline_layers(
    layers: nnx.Module, x, *args, pipeline: Optional[Pipeline] = None, mesh=None, keys=None, remat="none", aux=False
):
    """Run stacked ``layers`` on ``x`` as ``pipeline`` does: the result of :func:`scan_layers`.

    Args:
      layers: a module from :func:`~nnxscale.stack_layers` whose ``L`` layers are stored in
        the pipeline's stage order (:meth:`Pipeline.layer_order`; for GPipe the order they
        were created in), their leading axis laid out over ``pipeline.axis``; or a stack
        made with ``pipelined=False``, which runs whole, as a plain scan, on every stage.
      x: ``(B, ...)``, the first layer's input; ``B`` split into ``M`` microbatches of
        ``B/M`` rows (microbatch ``m`` is rows ``m, m+M, m+2M, ...``, so each is spread over
        every batch shard).
      args: passed to every layer: unchanged to every microbatch (rotary tables), or,
        wrapped in :class:`~nnxscale.layers.stack.Rows`, ``(B, ...)`` per-row values
        (positions, document ids) split into microbatches with ``x``.
      pipeline: the schedule; by default the one in force (:func:`use_pipeline`).
      mesh: the mesh (see :func:`use_pipeline`).
      keys: ``None``, or per-layer PRNG keys ``(L, ...)`` in layer order, as
        :func:`~nnxscale.scan_layers` takes them; layer ``l`` draws from
        ``jax.random.fold_in(keys[l], m*J + j)`` for microbatch ``m`` in batch shard ``j``
        of the ``J`` the pipeline splits manually (see the module docstring).
      remat: a policy of :data:`~nnxscale.layers.stack.REMAT_POLICIES`, applied to every layer.
      aux: every layer returns ``(x, aux)``, ``aux`` a pytree of means over its tokens (a
        mixture's :class:`~nnxscale.layers.moe.RouterStats`). Each layer's is averaged over
        the microbatches and batch shards, which equals the whole batch's.

    Returns ``(B, ...)`` like ``x``, replicated over the stage axis; with ``aux``,
    ``(that, aux stacked over the layers in layer order)`` as :func:`~nnxscale.scan_layers` returns.
    """
    if pipeline is None:
        active = _ACTIVE.get()
        if active is None:
            raise ConfigError("pipeline_layers: no pipeline given and none in force (nnxscale.layers.pipeline.use_pipeline)")
        pipeline, mesh = active[0], active[1] if mesh is None else mesh
    if not is_pipelined(layers):  # stack_layers(..., pipelined=False): whole on every stage
        graphdef, state = nnx.split(layers)
        return scan_state(graphdef, state, x, *(a.value if isinstance(a, Rows) else a for a in args), keys=keys,
                          remat=remat, aux=aux)  # fmt: skip
    mesh = mesh_for(pipeline, mesh)
    n = num_layers(layers)
    rules = current_rules()
    if getattr(x, "ndim", 0) < 1:
        raise ConfigError(f"pipeline_layers: x must have a leading batch dimension, got shape {jnp.shape(x)}")
    pipeline.check(n, x.shape[0], rules.batch_shard_count if rules is not None else 1)
    M, axis = pipeline.microbatches, pipeline.axis
    graphdef, state = nnx.split(layers)
    data, state_spec = manual_layout(state, rules, axis)
    rows = P(None, data) if data else P()

    split = lambda a: a.reshape((a.shape[0] // M, M) + a.shape[1:]).swapaxes(0, 1)  # noqa: E731  (M, B/M, ...)
    per_row = tuple(i for i, a in enumerate(args) if isinstance(a, Rows))
    for i in per_row:
        if jnp.shape(args[i].value)[:1] != x.shape[:1]:
            raise ConfigError(f"pipeline_layers: a Rows argument of shape {jnp.shape(args[i].value)} has not x's {x.shape[0]} rows")
    shared = tuple(None if i in per_row else a for i, a in enumerate(args))
    row_args = tuple(split(args[i].value) for i in per_row)
    operands = [state, split(x), shared, row_args]
    specs = [state_spec, rows, P(), rows]
    if keys is not None:  # into stage order, like the layers: a gather of L keys
        operands.append(keys[pipeline.layer_order(n)])
        specs.append(P(axis))
    program = functools.partial(_stage, graphdef=graphdef, pipeline=pipeline, data=data, remat=remat, per_row=per_row,
                                aux=aux)  # fmt: skip
    run = jax.shard_map(program, mesh=context_mesh(mesh), in_specs=tuple(specs), out_specs=(rows, P(axis)) if aux else rows,
                        axis_names=frozenset((axis,) + data))  # fmt: skip
    # Layers that scan stacks of their own run them unpipelined.
    with without_pipeline(), layers_run_by(None), attention.in_pipeline_stages():
        out = run(*operands)
    if aux:  # the statistics come out in stage order (position i holds layer layer_order[i])
        out, stats = out
        back = np.argsort(pipeline.layer_order(n))
        return out.swapaxes(0, 1).reshape(x.shape), jax.tree.map(lambda a: a[back], stats)
    return out.swapaxes(0, 1).reshape(x.shape)  # (B, ...)


def manual_axes(specs, rules) -> tuple[str, ...]:
    """The batch axes a pipeline stage runs manual over, for stacked parameters laid out as
    ``specs`` (their PartitionSpecs) by ``rules``.

    The batch axes that split no parameter: manual, a stage's gradients are summed over
    them once per step (the transpose of one ``pcast``); left to the partitioner, they would
    be all-reduced after every iteration, ``R*M + S - 1`` times over. Batch axes that also
    split parameters (FSDP) stay automatic, and the partitioner gathers each layer's weights
    where it is used, in every iteration.

    The expert axis is manual too when it splits a mixture's experts (first in their
    dimension's split, and not on the layers axis): each device then keeps its own experts
    inside the stage, and the layer sends tokens to them with ``all_to_all`` there
    (:mod:`nnxscale.layers.moe`); nothing of them is gathered.
    """
    used = {a for spec in specs for entry in spec for a in entry_axes(entry)}
    data = tuple(a for a in rules.batch_axes if a not in used)
    if EXPERT not in used or EXPERT not in rules.batch_axes:
        return data
    entries = [(i, entry_axes(e)) for spec in specs for i, e in enumerate(spec) if EXPERT in entry_axes(e)]
    names = [n for n in LOGICAL_NAMES if n != "batch" and EXPERT in (resolve_name(n, rules.rules.params, rules.sizes)[0] or ())]
    if names == ["expert"] and all(i > 0 and axes[0] == EXPERT for i, axes in entries):
        return data + (EXPERT,)
    return data


def manual_layout(state, rules, axis: str):
    """``(the batch axes the pipeline runs manual over, the stacked state's in_specs)``
    (:func:`manual_axes`)."""
    if rules is None:
        return (), P(axis)
    specs = state_specs(state, rules.mesh, rules)
    flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    manual = manual_axes(flat, rules)
    if EXPERT not in manual:
        return manual, P(axis)
    by_leaf = lambda spec: P(axis, *(EXPERT if EXPERT in entry_axes(e) else None for e in spec[1:]))  # noqa: E731
    return manual, jax.tree.map(by_leaf, specs, is_leaf=lambda x: isinstance(x, P))


def _stage(state, microbatches, args, row_args, keys=None, *, graphdef, pipeline: Pipeline, data: tuple, remat,
           per_row: tuple, aux: bool = False):  # fmt: skip
    """One stage's program. ``state``: its ``R*L/(S*R)`` layers; ``microbatches`` ``(M, B/M, ...)``;
    ``row_args``: the :class:`Rows` arguments (at positions ``per_row`` of ``args``), ``(M, B/M, ...)``.

    Work item ``k = r*M + m`` is microbatch ``m`` in repeat ``r``; stage ``s`` does item
    ``t - s`` at iteration ``t`` and hands its output to stage ``s+1`` (stage ``S-1`` to
    stage 0) with one ``ppermute``. Stage 0 reads its input from ``buffer``, which starts
    as the microbatches and collects what stage ``S-1`` finishes: a microbatch's next
    repeat, and at the end the outputs. Iterations outside ``0 <= t - s < R*M`` are the
    bubble: they compute on stale data and their results are never kept.
    """
    S, M, R, axis = pipeline.stages, pipeline.microbatches, pipeline.repeats, pipeline.axis
    s = jax.lax.axis_index(axis)
    # Stage order puts layer j of repeat r at j*R + r: a free reshape to (L/(S*R), R, ...)
    # from which every iteration picks its repeat. GPipe has nothing to pick (and picking
    # from an axis of size 1 costs XLA a buffer the size of the stage's layers).
    circular = R > 1
    by_repeat = lambda a: a.reshape((a.shape[0] // R, R) + a.shape[1:]) if circular else a  # noqa: E731
    layers = jax.tree.map(by_repeat, state)
    keys = None if keys is None else by_repeat(keys)
    layers = vary(layers, data)  # one gradient sum over the batch axes per step, at the end (see manual_axes)
    shard = jax.lax.axis_index(data) if data else 0
    shards = math.prod(jax.lax.axis_size(a) for a in data)
    buffer = jax.lax.pcast(microbatches, axis, to="varying")  # (M, B/M, ...)
    shift = [(i, (i + 1) % S) for i in range(S)]

    def collect(buffer, received, t):
        """Stage 0 keeps what stage S-1 finished one iteration ago: item ``t - S``."""
        k = t - S
        slot = k % M
        keep = (k >= 0) & (k < R * M)
        kept = jnp.where(keep, received, jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False))
        return jax.lax.dynamic_update_index_in_dim(buffer, kept, slot, 0)

    def iteration(carry, t):
        buffer, received = carry
        buffer = collect(buffer, received, t)
        k = t - s  # this stage's work item
        repeat = jnp.clip(k // M, 0, R - 1) if circular else None
        first = jax.lax.dynamic_index_in_dim(buffer, t % M, keepdims=False)
        h = jnp.where(s == 0, first, received)  # (B/M, ...)
        group_keys = None
        if keys is not None:
            layer_keys = keys if repeat is None else jax.lax.dynamic_index_in_dim(keys, repeat, axis=1, keepdims=False)
            group_keys = jax.vmap(jax.random.fold_in, (0, None))(layer_keys, (k % M) * shards + shard)
        layer_args = list(args)
        for i, a in zip(per_row, row_args, strict=True):  # this item's microbatch of each per-row argument
            layer_args[i] = jax.lax.dynamic_index_in_dim(a, k % M, keepdims=False)
        out = scan_state(graphdef, layers, h, *layer_args, keys=group_keys, remat=remat, pick=repeat, aux=aux)
        out, stats = out if aux else (out, None)
        return (buffer, jax.lax.ppermute(out, axis, shift)), stats

    received = jnp.zeros_like(buffer[0])
    steps = jnp.arange(pipeline.iterations)
    (buffer, received), stats = jax.lax.scan(iteration, (buffer, received), steps)
    buffer = collect(buffer, received, pipeline.iterations)
    # Every stage needs the outputs for what follows the pipeline (the head): one all-reduce.
    out = jax.lax.psum(jnp.where(s == 0, buffer, jnp.zeros_like(buffer)), axis)
    if not aux:
        return out
    return out, _stage_stats(stats, steps - s, M, R, data)


def _stage_stats(stats, items, M: int, R: int, data: tuple):
    """A stage's layers' statistics, averaged over the microbatches (and batch shards):
    ``stats`` leaves ``(iterations, L/(S*R), ...)``, one per iteration, of which those with
    a work item (``0 <= items < R*M``) count, each for its repeat; returns ``(R*L/(S*R), ...)``
    in the stage's order (layer ``j`` of repeat ``r`` at ``j*R + r``)."""
    repeat = jnp.clip(items // M, 0, R - 1)
    real = (items >= 0) & (items < R * M)
    weight = jnp.where(real[:, None] & (repeat[:, None] == jnp.arange(R)), 1.0 / M, 0.0)  # (iterations, R)

    def average(a):
        mean = jnp.einsum("tr,tg...->gr...", weight, a.astype(jnp.float32))
        mean = jax.lax.pmean(mean, data) if data else mean
        return mean.reshape((-1,) + mean.shape[2:]).astype(a.dtype)

    return jax.tree.map(average, stats)


# --------------------------------------------------------------------------------------
# Stage order: where the circular schedule keeps its layers
# --------------------------------------------------------------------------------------


def to_stage_order(tree, pipeline: Pipeline, shardings=None, *, donate: bool = False):
    """Stacked layers from layer order (as created, saved and run unpipelined) into stage order.

    Every leaf of ``tree`` whose layout puts ``pipeline.axis`` on its leading dimension is
    a stack of layers (the rules put ``layers`` there and nothing else): parameters and
    the optimizer's moments alike. Its groups of ``L/(S*R)`` layers move to the stages
    of the circular schedule (:meth:`Pipeline.layer_order`); other leaves are returned as
    they are. ``shardings``: a matching tree of ``NamedSharding``; by default each leaf's
    own ``.sharding`` (arrays, or ``jax.ShapeDtypeStruct`` to compile ahead of time).
    ``donate=True`` lets the result reuse the stacked leaves' memory (after a restore);
    otherwise the move needs about 1.25x the device's stacked bytes of temporary memory.

    The identity for GPipe, at no cost. Otherwise one program of collective-permutes over
    the stage axis, one per shift around the ring that some group takes, each of at most
    ``ceil(R/S)`` groups of every stacked leaf (:func:`stage_order_bytes`); run once after
    init or restore, never per step. :func:`to_layer_order` undoes it exactly, at the same
    cost.
    """
    return _regroup(tree, pipeline, shardings, donate, _LAYER_ORDER, _STAGE_ORDER)


def to_layer_order(tree, pipeline: Pipeline, shardings=None, *, donate: bool = False):
    """The inverse of :func:`to_stage_order`: what a checkpoint or an unpipelined run needs."""
    return _regroup(tree, pipeline, shardings, donate, _STAGE_ORDER, _LAYER_ORDER)


def stage_order_bytes(pipeline: Pipeline, stacked_bytes: int) -> int:
    """Bytes a device sends in :func:`to_stage_order` (or back), for ``stacked_bytes`` of
    stacked leaves held per device (its stage's share, after every other split)."""
    S, R = pipeline.stages, pipeline.repeats
    if R == 1 or S == 1:
        return 0
    width = sum(len(send[0]) for delta, _, send, _ in _rounds(S, R, _LAYER_ORDER, _STAGE_ORDER) if delta)
    return stacked_bytes * width // R


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where stacked layers sit, by groups of ``L/(S*R)``: group ``g`` at ``place(g, S, R)``,
    a (stage, slot) pair; ``interleaved``: a stage's slots alternate layer by layer."""

    place: Callable[[int, int, int], tuple[int, int]]
    interleaved: bool

    def slots(self, a, R: int):
        """A stage's block ``(R*L/(S*R), ...)`` as ``(R, L/(S*R), ...)``: slot first."""
        if self.interleaved:
            return a.reshape((a.shape[0] // R, R) + a.shape[1:]).swapaxes(0, 1)
        return a.reshape((R, a.shape[0] // R) + a.shape[1:])

    def block(self, slots):
        """The inverse of :meth:`slots`."""
        if self.interleaved:
            slots = slots.swapaxes(0, 1)
        return slots.reshape((-1,) + slots.shape[2:])


#: Layer order: stage ``g // R`` holds groups ``g`` in a row, as GPipe and unpipelined runs do.
_LAYER_ORDER = _Layout(lambda g, S, R: (g // R, g % R), interleaved=False)
#: Stage order (:meth:`Pipeline.layer_order`): group ``g`` on stage ``g % S``, as repeat ``g // S``.
_STAGE_ORDER = _Layout(lambda g, S, R: (g % S, g // S), interleaved=True)


@functools.lru_cache(maxsize=64)
def _rounds(S: int, R: int, src: _Layout, dst: _Layout) -> tuple:
    """Static moves of the ``S*R`` groups from layout ``src`` to ``dst``, one round per shift.

    Round ``delta`` sends from stage ``d`` to stage ``d + delta`` (mod ``S``):
    ``(delta, pairs, send, recv)`` with ``pairs`` the ``(d, d + delta)`` that send at all,
    ``send[d]`` the source slots stage ``d`` sends and ``recv[e]`` the destination slots
    stage ``e`` writes, padded to one width (padding: source slot 0, destination slot
    ``R``, which the write drops).
    """
    rounds = []
    for delta in range(S):
        send, recv = [[] for _ in range(S)], [[] for _ in range(S)]
        for g in range(S * R):
            (d, q), (e, p) = src.place(g, S, R), dst.place(g, S, R)
            if e == (d + delta) % S:
                send[d].append(q)
                recv[e].append(p)
        width = max(map(len, send))
        if width:
            pairs = tuple((d, (d + delta) % S) for d in range(S) if send[d])
            send = tuple(tuple(row + [0] * (width - len(row))) for row in send)
            recv = tuple(tuple(row + [R] * (width - len(row))) for row in recv)
            rounds.append((delta, pairs, send, recv))
    return tuple(rounds)


def _on_axis(sharding, axis: str) -> bool:
    spec = getattr(sharding, "spec", None)
    return bool(spec) and axis in entry_axes(spec[0])


def _regroup(tree, pipeline: Pipeline, shardings, donate: bool, src: _Layout, dst: _Layout):
    S, R, axis = pipeline.stages, pipeline.repeats, pipeline.axis
    if R == 1 or S == 1:
        return tree
    if shardings is None:
        shardings = jax.tree.map(lambda a: a.sharding, tree)
    leaves, treedef = jax.tree.flatten(tree)
    flat_shardings = treedef.flatten_up_to(shardings)
    stacked = [i for i, sh in enumerate(flat_shardings) if _on_axis(sh, axis)]
    if not stacked:
        return tree
    mesh = flat_shardings[stacked[0]].mesh
    for i in stacked:
        pipeline.check(leaves[i].shape[0])
    rounds = _rounds(S, R, src, dst)

    def regroup_local(a):  # one stage's block of a stacked leaf: (R*L/(S*R), ...)
        d = jax.lax.axis_index(axis)
        slots = src.slots(a, R)  # (R, L/(S*R), ...)
        out = jnp.zeros_like(slots)
        for delta, pairs, send, recv in rounds:
            block = slots[jnp.asarray(send)[d]]
            if delta:
                block = jax.lax.ppermute(block, axis, pairs)
            out = out.at[jnp.asarray(recv)[d]].set(block, mode="drop")
        return dst.block(out)

    def regroup(xs):  # named: compile logs and profiles say "regroup", not "<lambda>"
        return [regroup_local(a) for a in xs]

    move = jax.shard_map(regroup, mesh=mesh, in_specs=P(axis), out_specs=P(axis), axis_names=frozenset({axis}))
    program = jax.jit(move, out_shardings=[flat_shardings[i] for i in stacked], donate_argnums=0 if donate else ())
    moved = program([leaves[i] for i in stacked])
    for i, value in zip(stacked, moved):
        leaves[i] = value
    return jax.tree.unflatten(treedef, leaves)


# --------------------------------------------------------------------------------------
# What a schedule costs: for the planner
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """What a pipelined step costs beyond its layers' arithmetic, per device.

    ``microbatch_rows``: rows of one microbatch on one device; ``permute_bytes``: the
    ``collective-permute`` bytes of a step, one microbatch's activations per iteration
    in the forward pass and as many in the backward pass; ``boundary_bytes``: the
    ``all-reduce`` over the stage axis that hands the pipeline's output to every stage
    (forward) and sums the input's gradient (backward), each the device's whole batch of
    activations: the price of running the embedding and the head outside the pipeline
    (none for 1F1B, which runs them inside the schedule and instead sums their gradients
    over the stage axis once per step). ``in_flight``: the most work items (a microbatch
    through one group of layers) whose activations (or, recomputed, inputs) a stage holds at
    once: ``R*M`` for GPipe and circular, ``2SR-1`` for 1F1B (``2S-1`` without repeats);
    ``held_bytes``: what 1F1B's ring of them holds per device
    (stage inputs; under a remat policy each layer's input), 0 for the others, whose held
    activations grow with ``M`` (the planner's activation estimate).
    """

    schedule: str
    stages: int
    repeats: int
    microbatches: int
    layers_per_stage: int
    iterations: int
    bubble: float
    microbatch_rows: int
    permute_bytes: int
    boundary_bytes: int
    in_flight: int = 0
    held_bytes: int = 0


def pipeline_cost(
    pipeline: Pipeline, n_layers: int, activation_shape, dtype="float32", *, batch_shards: int = 1, backward: bool = True,
    remat: str = "none", routed: bool = False,
) -> PipelineCost:  # fmt: skip
    """:class:`PipelineCost` of running ``n_layers`` stacked layers through ``pipeline``.

    ``activation_shape``: the global shape of the layers' input, ``(B, T, C)`` for the
    residual stream; its batch splits ``batch_shards`` ways (the data and FSDP axes) and
    no other dimension is split. ``backward=False`` counts the forward pass alone.
    ``remat``: the policy, which decides what 1F1B's ring holds. ``routed``: a mixture of
    experts, for which 1F1B runs a forward pass for the router statistics first (one more
    pass of forward permutes). Validated like :meth:`Pipeline.check`.

    1F1B sends what GPipe sends: ``R*M + S - 1`` forward permutes (fill and steady ticks)
    and as many backward ones (steady and drain); the compiled step has exactly these on 4
    stages, and one fewer on 2, where the one-tick drain is inlined and XLA drops its
    permute, whose result no stage uses.
    """
    batch, rest = int(activation_shape[0]), math.prod(int(d) for d in activation_shape[1:])
    pipeline.check(n_layers, batch, batch_shards)
    rows = batch // (batch_shards * pipeline.microbatches)
    passes = (2 if backward else 1) + (1 if backward and routed and pipeline.one_f_one_b else 0)
    microbatch_bytes = rows * rest * itemsize(dtype)
    return PipelineCost(
        schedule=pipeline.schedule,
        stages=pipeline.stages,
        repeats=pipeline.repeats,
        microbatches=pipeline.microbatches,
        layers_per_stage=n_layers // pipeline.stages,
        iterations=pipeline.iterations,
        bubble=pipeline.bubble,
        microbatch_rows=rows,
        permute_bytes=passes * pipeline.iterations * microbatch_bytes,
        boundary_bytes=0 if pipeline.one_f_one_b else passes * pipeline.microbatches * microbatch_bytes,
        in_flight=2 * pipeline.stages * pipeline.repeats - 1 if pipeline.one_f_one_b else pipeline.repeats * pipeline.microbatches,
        held_bytes=_ring_bytes(pipeline, n_layers, microbatch_bytes, remat),
    )


def _ring_bytes(pipeline: Pipeline, n_layers: int, microbatch_bytes: int, remat: str) -> int:
    """What 1F1B's ring holds per device: ``2SR-1`` work items' stage inputs, or under a remat
    policy what it keeps of each of the item's ``L/(S*R)`` layers (under ``full`` its input;
    ``dots`` keeps more, counted as ``full``)."""
    if not pipeline.one_f_one_b:
        return 0
    S, R = pipeline.stages, pipeline.repeats
    per_slot = microbatch_bytes if remat == "none" else (n_layers // (S * R)) * microbatch_bytes
    return (2 * S * R - 1) * per_slot
