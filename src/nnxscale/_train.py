"""Train any Flax NNX language model in its sharded layout on any mesh, checkpoint, resume exactly.

The trainer names no model. The model is a preset of a registered family (``--model
gpt2-mini``: :mod:`nnxscale.models`), or your own module (``nnxscale.train(cfg,
model=factory)``); either way it becomes a :class:`RunModel`, and everything here asks it.

The loop reads top to bottom: setup (mesh, rules, model, optimizer, shardings), state
(fresh sharded init, ``--init-from``, or resume from the run directory), then the loop
(batch -> jitted step -> log / eval / save), then the end (final save, loss curve).

The train state is one pytree of plain dicts, every leaf a sharded ``jax.Array``::

    {"params": {...}, "opt_state": optax state, "step": int32[], "key": uint32[2]}

Parameters take the layout of the rules; the optimizer state takes the layout of the
parameter it belongs to (``optax.tree_map_params``); step and key are replicated. The
step is a ``jax.jit`` over that pytree with buffer donation, so the host does no NNX
graph walk per step. Dropout keys are ``fold_in(key, step)``: a resumed run draws exactly
the keys an uninterrupted one would.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import functools
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from nnxscale import _data as datalib
from nnxscale import _text as text
from nnxscale._activations import use_rules
from nnxscale._checkpoint import Checkpointer, checkpoint_dir
from nnxscale._config import ConfigError, TrainConfig, config_conflicts, flag
from nnxscale._devices import peak_flops
from nnxscale._layout import format_bytes
from nnxscale._mesh import format_mesh, make_mesh, process_findings
from nnxscale._progress import ProgressBar
from nnxscale._rules import MeshRules, resolve
from nnxscale._runlock import RunLock
from nnxscale._sharding import abstract_state, layout_bytes, sharded_init, variable_logical_axes
from nnxscale._watchdog import ProgressWatchdog, timeout_from
from nnxscale.distributed import StopVote, current
from nnxscale.errors import DivergenceError, ModelError, RunFileError, storage_error
from nnxscale.models import (
    FAMILIES, ModelDims, ModelFamily, architecture_differences, find_preset, is_pretrained_dir, next_token_loss,
    pretrained_family,
)  # fmt: skip
from nnxscale.pipeline import STAGE, Pipeline, to_layer_order, to_stage_order, use_pipeline
from nnxscale.stack import LAYERS

#: Training steps dispatched ahead of the host (see the loop).
MAX_IN_FLIGHT = 2


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


# --------------------------------------------------------------------------------------
# The model of a run: a family's preset, or your own module
# --------------------------------------------------------------------------------------

#: TrainConfig fields that set a family's config (see ``ModelFamily.run_options``).
RUN_OPTIONS = ("dropout", "dtype", "remat")


@dataclasses.dataclass(frozen=True)
class RunModel:
    """The model a run trains: a preset of a registered family, or your own module.

    ``build(rngs)`` creates it (seeded by ``rngs``); ``loss(model, inputs, targets, *,
    rngs)`` is its scalar loss (default :func:`nnxscale.models.next_token_loss`). A family's
    model also has its ``family`` and ``config`` (with this run's options), hence its
    dimensions, FLOPs per token and Hugging Face import; your own module has neither.
    """

    name: str
    build: Callable[[nnx.Rngs], nnx.Module]
    loss: Callable
    family: Optional[ModelFamily] = None
    config: Any = None

    @property
    def dims(self) -> Optional[ModelDims]:
        return None if self.family is None else self.family.dims(self.config)

    def describe(self) -> dict:
        """What ``config.json`` records of the model: the family and its config."""
        if self.family is None:
            return {"family": None}
        return {"family": self.family.name, **dataclasses.asdict(self.config)}


def model_architecture(name: str, recorded: Optional[dict] = None) -> tuple[ModelFamily, Any]:
    """``(family, config)`` of ``--model NAME``: a preset of any family, or a Hugging Face
    directory (``config.json`` + safetensors) whose ``config.json`` gives the architecture.

    ``recorded``: the ``model`` record of a run's ``config.json`` (family and config), used
    when ``name`` is a directory that is no longer there, so a run trained from a Hugging
    Face directory can still be sampled and resumed.
    """
    if is_pretrained_dir(name):
        family = pretrained_family(name)
        return family, family.pretrained_config(name)
    try:
        return find_preset(name)
    except ModelError:
        if recorded and recorded.get("family") in FAMILIES:
            family = FAMILIES[recorded["family"]]
            kind = type(next(iter(family.presets.values())))
            return family, kind.from_dict({k: v for k, v in recorded.items() if k != "family"})
        if "/" in name or Path(name).exists():
            raise ModelError(
                f"--model {name}: not a Hugging Face model directory (config.json and model.safetensors, "
                "or model.safetensors.index.json), and not a preset"
            ) from None
        raise


def run_model(
    cfg: TrainConfig, model: Optional[Callable] = None, loss: Optional[Callable] = None, *, recorded: Optional[dict] = None
) -> RunModel:
    """The :class:`RunModel` of ``cfg``: the preset ``cfg.model`` (or the architecture of
    the Hugging Face directory ``cfg.model``) with ``cfg``'s run options, or, given
    ``model`` (a function ``rngs -> nnx.Module``), that module, named ``cfg.model``.
    ``recorded``: see :func:`model_architecture`.

    Raises ConfigError for an unknown preset (listing every family's), a run option the
    family does not take, or a run option set for your own module (it sets its own).
    """
    defaults = TrainConfig()
    changed = {k: getattr(cfg, k) for k in RUN_OPTIONS if getattr(cfg, k) != getattr(defaults, k)}
    if model is not None:
        if not callable(model):
            raise ConfigError(f"model= must be a function rngs -> nnx.Module, got {type(model).__name__}")
        if changed:
            given = ", ".join(f"{flag(k)} {v}" for k, v in changed.items())
            raise ConfigError(f"{given}: these set a family preset's options; your own module (model=) sets its own")
        return RunModel(cfg.model, model, loss or next_token_loss)
    family, preset = model_architecture(cfg.model, recorded)
    if unsupported := [k for k in changed if k not in family.run_options]:
        given = ", ".join(f"{flag(k)} {changed[k]}" for k in unsupported)
        raise ConfigError(f"{given}: {cfg.model} ({family.name}) has no such option; it takes {', '.join(family.run_options)}")
    config = dataclasses.replace(preset, **{k: getattr(cfg, k) for k in family.run_options})
    return RunModel(cfg.model, lambda rngs: family.build(config, rngs=rngs), loss or family.loss, family, config)


# --------------------------------------------------------------------------------------
# The optimizer: AdamW, decay from Variable metadata
# --------------------------------------------------------------------------------------

#: The logical name of a model's width, the residual stream.
WIDTH = "embed"


def decays(v: nnx.Variable) -> bool:
    """Whether AdamW's weight decay applies to this parameter: from its metadata, never its name.

    A ``weight_decay`` metadata flag decides when there is one
    (``nnxscale.logical(init, "embed", weight_decay=False)``). Otherwise the matrices decay:
    parameters whose logical axes hold the width (``embed``) and at least one more axis
    besides the stacked ``layers``: token and position embeddings, every projection. Norm
    scales (``embed`` alone) and biases (no ``embed``: ``(mlp,)``, ``(None, heads, kv)``)
    never do. A parameter without logical axes decays when it has two or more dimensions
    (nanoGPT's rule).
    """
    flag_value = v.get_metadata().get("weight_decay")
    if flag_value is not None:
        return bool(flag_value)
    names = variable_logical_axes(v)
    if names is None:
        return len(v.get_value().shape) >= 2
    axes = [n for n in names if n != LAYERS]
    return WIDTH in axes and len(axes) >= 2


def decay_mask(state) -> dict:
    """``{path: bool}`` as a plain dict like the params: :func:`decays` of each Variable."""
    return nnx.to_pure_dict(jax.tree.map(decays, state, is_leaf=_is_var))


def describe_decay(mask: dict, params: dict, weight_decay: float) -> str:
    """One line: how many parameter arrays decay, and how many of their bytes."""
    flags, arrays = jax.tree.leaves(mask), jax.tree.leaves(params)
    nbytes = [math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays]
    decayed = sum(b for b, f in zip(nbytes, flags) if f)
    return (
        f"weight decay {weight_decay:g} on {sum(flags)} of {len(flags)} parameter arrays, "
        f"{format_bytes(decayed)} of {format_bytes(sum(nbytes))} (matrices; not norms or biases)"
    )


def make_optimizer(cfg: TrainConfig, mask):
    """``(optax transform, lr schedule)``: AdamW, warmup + cosine, global-norm clipping.

    ``mask`` (:func:`decay_mask`, same structure as the params) says which parameters decay.
    """
    o = cfg.optim
    length = o.decay_steps or cfg.steps
    warmup = min(o.warmup_steps, max(length - 1, 0))
    if o.min_lr_ratio == 1.0 and warmup > 0:
        # No decay: the same values as the cosine from peak to peak, without the run's length
        # among the program's constants, so runs of any length share one compiled step.
        ramp = optax.linear_schedule(init_value=0.0, end_value=o.lr, transition_steps=warmup)
        schedule = optax.join_schedules([ramp, optax.constant_schedule(o.lr)], [warmup])
    else:
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=o.lr,
            warmup_steps=warmup,
            decay_steps=max(length, warmup + 1),
            end_value=o.lr * o.min_lr_ratio,
        )
    parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
    parts.append(optax.adamw(schedule, b1=o.beta1, b2=o.beta2, weight_decay=o.weight_decay, mask=mask))
    return optax.chain(*parts), schedule


# --------------------------------------------------------------------------------------
# Setup: everything derived from a config before any array exists
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    """Everything derived from a config before any array exists.

    This is also the ahead-of-time path: ``make_train_step(s).lower(s.abstract,
    s.abstract_batch).compile()`` compiles the real step for this mesh without allocating
    it, and the compiled program's ``memory_analysis()`` and ``as_text()`` say what it
    needs per device and what it communicates (see ``nnxscale.plan``).
    """

    cfg: TrainConfig
    mesh: Any
    rules: MeshRules  # the rules resolved against the mesh: every layout question goes here
    model: RunModel
    graphdef: Any
    tx: Any
    schedule: Callable
    decay_mask: dict  # same structure as the params: which ones AdamW decays
    state_shardings: dict
    abstract: dict  # ShapeDtypeStructs with shardings: the restore target
    batch_sharding: NamedSharding
    abstract_batch: dict  # {"inputs", "targets"}: (B, T) int32 ShapeDtypeStructs with batch_sharding
    factory: Callable[[], nnx.Module]  # builds the model (seeded)
    init_fn: Callable  # params -> the whole train state
    pipeline: Optional[Pipeline] = None  # the schedule over the mesh's stage axis; None without one
    stacked_layers: Optional[int] = None  # depth of the stacked layers the pipeline runs

    @property
    def param_shardings(self):
        return self.state_shardings["params"]

    @property
    def num_params(self) -> int:
        return sum(math.prod(a.shape) for a in jax.tree.leaves(self.abstract["params"]))

    def vocab_size(self) -> int:
        """The model's vocabulary: its family's, or the last axis of its own module's logits
        (traced on a ``(1, seq_len)`` batch, nothing allocated)."""
        if self.model.dims is not None:
            return self.model.dims.vocab_size
        tokens = jax.ShapeDtypeStruct((1, self.cfg.data.seq_len), jnp.int32)
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            logits = jax.eval_shape(lambda p, x: nnx.merge(self.graphdef, p)(x), self.abstract["params"], tokens)
        return int(logits.shape[-1])

    def flops_per_token(self) -> int:
        """Training FLOPs per token at this run's sequence length: the family's formula, or
        6N for your own module (no attention term)."""
        if self.model.family is not None:
            return self.model.family.flops_per_token(self.model.config, self.cfg.data.seq_len)
        return 6 * self.num_params


def _pure(tree):
    """nnx State (Variables at the leaves) -> plain nested dict of the Variables' values."""
    return nnx.to_pure_dict(tree)


def check_shapes(cfg: TrainConfig, rules: MeshRules, model: RunModel) -> None:
    """The sequence fits the model's context, the batch splits over the mesh and micro-batches."""
    d = cfg.data
    if model.dims is not None and d.seq_len > model.dims.context:
        raise ConfigError(f"--seq-len {d.seq_len} is longer than {cfg.model}'s context of {model.dims.context} tokens")
    shards = rules.batch_shard_count
    accum = cfg.optim.grad_accum
    if d.batch_size % (shards * accum):
        split = ",".join(f"{a}={rules.sizes[a]}" for a in rules.batch_axes) or "none"
        raise ConfigError(
            f"--batch-size {d.batch_size} must be a multiple of {shards * accum}: the batch is split "
            f"{shards} ways (mesh axes {split}) and into {accum} accumulation micro-batches"
        )


def check_params_only(model: RunModel, state) -> None:
    """The train state is the model's parameters: refuse a module that holds other state.

    Flax modules built with ``rngs`` for dropout (``nnx.Dropout(rate, rngs=rngs)``) keep RNG
    keys and counters as Variables, which the optimizer cannot update.
    """
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_var)[0]
    others = [(jax.tree_util.keystr(p), type(v).__name__) for p, v in flat if not isinstance(v, nnx.Param)]
    if others:
        path, kind = others[0]
        more = f" and {len(others) - 1} more" if len(others) > 1 else ""
        raise ConfigError(
            f"{model.name} holds state that is not a parameter ({kind} at {path}{more}); nnxscale trains nnx.Param "
            "only: create nnx.Dropout (and other random layers) without rngs and pass rngs= when calling them"
        )


def run_pipeline(cfg: TrainConfig, rules: MeshRules) -> Optional[Pipeline]:
    """The pipeline of a run: ``--microbatches`` and ``--pipeline-repeats`` over the mesh's
    ``stage`` axis, or ``None`` on a mesh without one. Raises ConfigError, one line each, for
    a stage axis without ``--microbatches``, ``--microbatches`` without a stage axis, and
    (from :class:`~nnxscale.pipeline.Pipeline`) fewer microbatches than stages."""
    sizes = rules.sizes
    mesh = format_mesh(sizes)
    if STAGE not in sizes:
        if cfg.microbatches is not None:
            n = math.prod(sizes.values())
            example = f"stage=2,data={n // 2}" if n % 2 == 0 and n > 1 else "stage=2,..."
            raise ConfigError(
                f"--microbatches {cfg.microbatches} asks for a pipeline, but mesh {mesh} has no '{STAGE}' axis to put "
                f"its stages on: add one (e.g. --mesh {example}), or drop --microbatches"
            )
        return None
    stages = sizes[STAGE]
    if cfg.microbatches is None:
        rows = cfg.data.batch_size // max(rules.batch_shard_count, 1)
        fits = [m for m in (2 * stages, stages, 4 * stages) if rows % m == 0] or [2 * stages]
        raise ConfigError(
            f"mesh {mesh} has a '{STAGE}' axis: its {stages} pipeline stages need --microbatches M, at least {stages} "
            f"and dividing the {rows} rows each batch shard holds (e.g. --microbatches {fits[0]}); "
            f"--pipeline-repeats R > 1 makes the schedule circular"
        )
    return Pipeline.for_mesh(sizes, cfg.microbatches, cfg.pipeline_repeats)


def _axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def check_pipeline(pipe: Pipeline, cfg: TrainConfig, rules: MeshRules, name: str, params) -> int:
    """The model has stacked layers the pipeline can split, and they and the batch fit it
    (:meth:`Pipeline.check`). ``params``: ``(shape, PartitionSpec)`` of every parameter.
    Returns the stacked depth; raises ConfigError in one line."""
    depths = sorted({int(shape[0]) for shape, spec in params if spec and STAGE in _axes_of(spec[0])})
    if not depths:
        raise ConfigError(
            f"{name} has no stacked layers for the {pipe.stages} pipeline stages of mesh {format_mesh(rules.sizes)}: "
            "a pipeline runs layers created with nnxscale.stack_layers and run with nnxscale.scan_layers "
            f"(the rules put their '{LAYERS}' axis on '{STAGE}'); train this model on a mesh without a stage axis"
        )
    for n in depths:
        pipe.check(n, cfg.data.batch_size, rules.batch_shard_count)
    return depths[-1]


def pipeline_notes(pipe: Pipeline, rules: MeshRules, specs) -> list[str]:
    """What to know about a pipeline beside the other mesh axes (``specs``: the parameters'
    PartitionSpecs): FSDP beside ``stage`` gathers every layer once per iteration."""
    used = {a for spec in specs for entry in spec for a in _axes_of(entry)}
    fsdp = [a for a in rules.batch_axes if a in used and rules.sizes[a] > 1]
    if not fsdp:
        return []
    gathers = pipe.iterations / pipe.repeats
    return [
        f"FSDP ({', '.join(fsdp)}) beside the stage axis: every pipeline iteration gathers its layers' weights and "
        f"reduce-scatters their gradients, so a step gathers each of a stage's layers {gathers:g} times "
        f"((R*M + S - 1)/R) where FSDP without a pipeline gathers it once; prefer data beside stage"
    ]


def setup(
    cfg: TrainConfig,
    mesh=None,
    *,
    model: Optional[Callable] = None,
    loss: Optional[Callable] = None,
    recorded: Optional[dict] = None,
) -> Setup:
    """Validate ``cfg`` against the devices and build the sharded plan (no arrays yet).

    ``model`` and ``loss``: your own module instead of the preset ``cfg.model`` (see
    :func:`train`). ``recorded``: a run's record of its model (see :func:`model_architecture`).
    On a mesh with a ``stage`` axis the plan includes the pipeline
    (``Setup.pipeline``), checked against the model's depth and the batch here, before
    anything is allocated.
    """
    cfg.validate()
    mesh = make_mesh(cfg.mesh) if mesh is None else mesh
    rules = resolve(cfg.rules, mesh, min_shard_bytes=cfg.min_shard_bytes)
    m = run_model(cfg, model, loss, recorded=recorded)
    check_shapes(cfg, rules, m)
    pipe = run_pipeline(cfg, rules)
    d = cfg.data

    factory = lambda: m.build(nnx.Rngs(cfg.seed))  # noqa: E731
    graphdef, abs_model_state = abstract_state(factory, mesh, rules)
    check_params_only(m, abs_model_state)
    param_sh = _pure(jax.tree.map(lambda v: v.replace(v.get_value().sharding), abs_model_state, is_leaf=_is_var))
    stacked = None
    if pipe is not None:
        shapes = jax.tree.leaves(_pure(abs_model_state))
        shardings = jax.tree.leaves(param_sh, is_leaf=lambda x: isinstance(x, NamedSharding))
        stacked = check_pipeline(pipe, cfg, rules, m.name, [(a.shape, sh.spec) for a, sh in zip(shapes, shardings)])
    mask = decay_mask(abs_model_state)
    tx, schedule = make_optimizer(cfg, mask)
    replicated = NamedSharding(mesh, P())

    def state_from(params):
        return {
            "params": params,
            "opt_state": tx.init(params),
            "step": jnp.zeros((), jnp.int32),
            "key": jax.random.key_data(jax.random.key(cfg.seed)),
        }

    abs_params = _pure(abs_model_state)  # ShapeDtypeStructs: no second trace of the model
    abs_state = jax.eval_shape(state_from, abs_params)
    opt_sh = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abs_state["opt_state"],
        param_sh,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    state_sh = {"params": param_sh, "opt_state": opt_sh, "step": replicated, "key": replicated}
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abs_state, state_sh
    )

    def init_fn(params):
        return state_from(params)

    batch_sharding = rules.sharding(rules.batch_spec())
    batch = jax.ShapeDtypeStruct((d.batch_size, d.seq_len), jnp.int32, sharding=batch_sharding)
    return Setup(
        cfg=cfg,
        mesh=mesh,
        rules=rules,
        model=m,
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        decay_mask=mask,
        state_shardings=state_sh,
        abstract=abstract,
        batch_sharding=batch_sharding,
        abstract_batch={"inputs": batch, "targets": batch},
        factory=factory,
        init_fn=init_fn,
        pipeline=pipe,
        stacked_layers=stacked,
    )


def init_state(s: Setup, params=None):
    """Create the train state directly in its sharded layout (or around given params), in
    the order the step runs it (:func:`run_order`)."""
    if params is None:  # the one sharded-init path, shared with `nnxscale init`
        params = _pure(nnx.state(sharded_init(s.factory, s.mesh, s.rules)))
    with jax.set_mesh(s.mesh):
        state = jax.jit(s.init_fn, out_shardings=s.state_shardings, donate_argnums=0)(params)
    return run_order(s, state)


def run_order(s: Setup, state, *, donate: bool = True):
    """A train state in layer order (created, restored) -> the order the step runs it.

    For the circular pipeline that is stage order (:func:`nnxscale.pipeline.to_stage_order`,
    parameters and optimizer moments alike, once per init or restore); otherwise the state
    itself. ``donate``: the layer-order state is used up.
    """
    if s.pipeline is None or s.pipeline.repeats == 1:
        return state
    return to_stage_order(state, s.pipeline, s.state_shardings, donate=donate)


def saved_order(s: Setup, state):
    """The inverse of :func:`run_order`, for what leaves the run: checkpoints are always in
    layer order, so they move between pipelined and unpipelined meshes. ``state`` is kept
    (the circular pipeline's copy costs one more stacked state of memory while it is saved)."""
    if s.pipeline is None or s.pipeline.repeats == 1:
        return state
    return to_layer_order(state, s.pipeline, s.state_shardings)


def describe_pipeline(s: Setup) -> str:
    """One line: the run's pipeline layout (schedule, layers per stage, microbatches, bubble)."""
    p, n = s.pipeline, s.stacked_layers
    rows = s.cfg.data.batch_size // (s.rules.batch_shard_count * p.microbatches)
    groups = f", {p.repeats} groups of {n // (p.stages * p.repeats)} per stage" if p.repeats > 1 else ""
    return (
        f"pipeline: {'GPipe' if p.repeats == 1 else 'circular'} over {p.stages} stages, {n // p.stages} of {n} layers "
        f"per stage{groups}; {p.microbatches} microbatches of {rows} rows per batch shard, "
        f"{p.iterations} iterations a pass, bubble {p.bubble:.1%}"
    )


def loss_fn(graphdef, params, inputs, targets, key, loss: Callable):
    """``loss`` of one (micro-)batch; ``key`` seeds dropout (``None``: evaluation)."""
    model = nnx.merge(graphdef, params)
    return loss(model, inputs, targets, rngs=None if key is None else nnx.Rngs(dropout=key))


def make_train_step(s: Setup, *, vote: bool = False):
    """The jitted step: ``(state, batch) -> (state, metrics)``; donates the old state.

    ``vote``: the step takes a third argument, every process's stop request
    (:meth:`nnxscale.distributed.StopVote.ballot`), and ``metrics["stop"]`` is the largest:
    the vote's all-reduce is part of the step, so it can never run in a different order
    than the step's own collectives on some device (see docs/multiprocess.md).
    """
    graphdef, tx, schedule, objective = s.graphdef, s.tx, s.schedule, s.model.loss
    accum = s.cfg.optim.grad_accum
    grad_fn = jax.value_and_grad(lambda p, x, y, k: loss_fn(graphdef, p, x, y, k, objective))

    def step(state, batch, votes=None):
        params = state["params"]
        key = jax.random.fold_in(jax.random.wrap_key_data(state["key"]), state["step"])
        x, y = batch["inputs"], batch["targets"]  # (B, T) int32
        if accum == 1:
            loss, grads = grad_fn(params, x, y, key)
        else:
            # Strided micro-batches keep every micro-batch spread over all batch shards.
            micro = lambda a: a.reshape(a.shape[0] // accum, accum, a.shape[1]).swapaxes(0, 1)  # noqa: E731

            def body(carry, xs):
                loss_sum, grad_sum = carry
                i, xm, ym = xs
                loss_i, grads_i = grad_fn(params, xm, ym, jax.random.fold_in(key, i))
                return (loss_sum + loss_i, jax.tree.map(jnp.add, grad_sum, grads_i)), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            (loss, grads), _ = jax.lax.scan(body, (0.0, zeros), (jnp.arange(accum), micro(x), micro(y)))
            loss, grads = loss / accum, jax.tree.map(lambda g: g / accum, grads)
        grads = jax.lax.with_sharding_constraint(grads, s.param_shardings)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "key": state["key"],
        }
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"])}
        if votes is not None:
            metrics["stop"] = StopVote.reduce(votes)
        return skip_nonfinite(state, new_state, metrics)

    in_shardings = (s.state_shardings, s.batch_sharding)
    if vote:
        in_shardings += (StopVote.sharding(s.mesh),)
    return jax.jit(
        _under_rules(step, s),
        in_shardings=in_shardings,
        out_shardings=(s.state_shardings, None),
        donate_argnums=0,
    )


def skip_nonfinite(state, new_state, metrics):
    """The divergence guard, inside the jitted step: ``(state, metrics)`` to return.

    When the loss or the gradient norm is not finite, the step's update is skipped: the
    parameters and the optimizer state (its moments and its count) stay as they were, so
    a NaN or Inf never reaches them or a checkpoint. The step counter advances either way
    (the batch is used up), and ``metrics["skipped"]`` is 1 for a skipped step, else 0.

    A select per array, with no host round trip (``lax.cond`` would read the predicate on
    the host on GPUs). Measured for gpt2 on data=8, batch 8 x 1024: the parameters' select
    fuses into the update for free; the optimizer state's keeps one moment's worth of
    temporary memory per device (step temp 2.76 -> 3.28 GiB).
    """
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    kept = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, state)
    kept["step"] = new_state["step"]
    return kept, {**metrics, "skipped": jnp.where(ok, 0, 1).astype(jnp.int32)}


def make_eval_step(s: Setup):
    graphdef, objective = s.graphdef, s.model.loss
    return jax.jit(
        _under_rules(lambda params, batch: loss_fn(graphdef, params, batch["inputs"], batch["targets"], None, objective), s),
        in_shardings=(s.param_shardings, s.batch_sharding),
    )


def _under_rules(fn: Callable, s: Setup) -> Callable:
    """``fn`` traced with the run's rules in force, so the model's ``constrain`` calls apply
    them, and its pipeline, so :func:`nnxscale.scan_layers` runs the stages."""

    @functools.wraps(fn)
    def traced(*args):
        with use_rules(s.rules), use_pipeline(s.pipeline, s.mesh):
            return fn(*args)

    return traced


# --------------------------------------------------------------------------------------
# Run directory: config, metrics, plot
# --------------------------------------------------------------------------------------


def _write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file, then a rename."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise storage_error("writing", path, e) from None


def saved_config(run_dir) -> Optional[dict]:
    """The ``train`` config a run directory's ``config.json`` holds (a dict), or ``None``.

    Raises RunFileError naming the file if it cannot be read or is not a config.
    """
    path = Path(run_dir) / "config.json"
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except OSError as e:
        raise storage_error("reading", path, e) from None
    except ValueError:  # not JSON, or not text at all
        raise RunFileError(f"{path} is not valid JSON; fix or remove it") from None
    saved = saved.get("train", saved) if isinstance(saved, dict) else saved
    try:
        TrainConfig.from_dict(saved, source=str(path))
    except ConfigError as e:
        raise RunFileError(f"{e}; fix or remove it") from None
    return saved


def _fix_schedule_length(cfg: TrainConfig, run_dir: Path) -> TrainConfig:
    """The LR schedule's length is set by a run's first command and kept on resume.

    So ``--steps`` can grow when resuming without restarting warmup or stretching the decay:
    past the schedule's end the learning rate stays at its final value.
    """
    if cfg.optim.decay_steps is not None:
        return cfg
    saved = saved_config(run_dir)
    length = (saved or {}).get("optim", {}).get("decay_steps") or cfg.steps
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, decay_steps=length))


def check_run_dir(cfg: TrainConfig, run_dir: Path) -> None:
    """Refuse a run directory whose saved config makes this a different experiment."""
    saved = saved_config(run_dir)
    if saved is None:
        return
    conflicts = config_conflicts(saved, cfg.to_dict())
    if conflicts:
        raise ConfigError(
            f"run directory {run_dir} holds a different run ("
            + "; ".join(conflicts)
            + "): use another --run-dir, or repeat the original settings to resume"
        )


def plot_metrics(run_dir: Path) -> Optional[Path]:
    """Draw ``loss.png`` (train and validation loss against step) from ``metrics.jsonl``."""
    rows = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]  # null: a skipped step
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"nnxscale: {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = run_dir / "loss.png"
    try:
        fig.savefig(out)
    except OSError as e:
        raise storage_error("writing", out, e) from None
    finally:
        plt.close(fig)
    return out


def _json_line(record: dict) -> str:
    """One strict JSON line: NaN and Inf become ``null`` (bare ``NaN`` is not JSON)."""
    clean = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in record.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def _append_metrics(path: Path, record: dict) -> None:
    """Append one record to ``metrics.jsonl``.

    A write that fails part-way (a full disk) is cut back off, so the file holds whole
    lines only; a crash in the middle of the write leaves at most a partial last line,
    which :func:`_repair_metrics` removes when the run resumes.
    """
    data = memoryview(_json_line(record).encode())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise storage_error("writing", path, e) from None
    try:
        size = os.fstat(fd).st_size
        try:
            while data:  # a short write is followed by one that reports why (ENOSPC, EFBIG, ...)
                written = os.write(fd, data)
                if not written:
                    raise OSError(errno.EIO, "nothing written")
                data = data[written:]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise storage_error("writing", path, e) from None
    finally:
        os.close(fd)


def _metrics_lines(path: Path) -> list[tuple[str, Optional[dict]]]:
    """``(line, record)`` per line of ``metrics.jsonl``; a partial last line has record ``None``.

    Raises RunFileError naming the file and line for any other line that is not a record.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise storage_error("reading", path, e) from None
    lines = text.splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with a step")
        except ValueError as e:
            if number == len(lines) and not text.endswith("\n"):
                out.append((line, None))  # cut off by a crash while it was written
                break
            raise RunFileError(f"{path} line {number} is not a metrics record ({e}); fix or remove that line") from None
        out.append((line, record))
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``metrics.jsonl``, oldest first (a partial last line is left out)."""
    return [r for _, r in _metrics_lines(Path(run_dir) / "metrics.jsonl") if r is not None]


def _repair_metrics(path: Path, last_step: int) -> None:
    """Drop records past the checkpoint being resumed from (they are logged again), and a
    partial last line left by a crash. Rewrites the file atomically, and only if needed."""
    lines = _metrics_lines(path)
    keep = [line for line, r in lines if r is not None and r["step"] <= last_step]
    if len(keep) < len(lines):
        _write_atomic(path, "".join(line + "\n" for line in keep))


# --------------------------------------------------------------------------------------
# Initial state: fresh, --init-from, or resume
# --------------------------------------------------------------------------------------


def load_init_params(s: Setup, source: str, *, warn: Callable[[str], None] = print):
    """Parameters from a seed checkpoint (``nnxscale init``, any run directory) or a Hugging
    Face directory of the run's family, in this run's layout and parameter dtypes.

    From a run directory: its newest intact checkpoint (``warn`` names damaged newer ones).
    From a Hugging Face directory: its architecture must be the preset's; dropout, compute
    dtype and remat are this run's own, and weights stored in another dtype (bfloat16) are
    cast to this run's.
    """
    path = Path(source)
    if is_pretrained_dir(path) and not checkpoint_dir(path).exists():
        family, m = pretrained_family(path), s.model
        if m.family is None:
            raise ConfigError(
                f"--init-from {path} is a Hugging Face {family.name} directory, but this run trains your own module "
                "(model=): start it from a seed checkpoint of that module, or train a preset"
            )
        if family is not m.family:
            raise ConfigError(f"--init-from {path} holds a {family.name} model, but --model {m.name} is a {m.family.name} preset")
        model = family.from_pretrained(path, mesh=s.mesh, rules=s.rules)
        if differences := architecture_differences(family, model.config, m.config):
            raise ConfigError(f"--init-from {path} is not the architecture of --model {m.name} ({'; '.join(differences)})")
        params = _pure(nnx.state(model))
        return jax.tree.map(lambda a, want: a if a.dtype == want.dtype else a.astype(want.dtype), params, s.abstract["params"])
    ckpt_root = checkpoint_dir(path)
    if not ckpt_root.exists():
        raise ConfigError(
            f"--init-from {path}: neither a Hugging Face model directory (config.json + model.safetensors) "
            "nor an nnxscale run directory with checkpoints"
        )
    with Checkpointer(ckpt_root, async_save=False) as ckpt:
        _, restored, _ = ckpt.restore_intact({"params": s.abstract["params"]}, warn=warn)
    return restored["params"]


# --------------------------------------------------------------------------------------
# Data: text through the run's tokenizer, or token files
# --------------------------------------------------------------------------------------

#: A run directory's copy of the tokenizer it trains with (and ``sample`` decodes with).
TOKENIZER_FILE = "tokenizer.json"
#: Copied with it when the source has one: it names the end-of-text token.
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def run_tokenizer(cfg: TrainConfig, run_dir) -> Optional[text.TextTokenizer]:
    """The tokenizer of a run, ``None`` for bytes: the run directory's own copy (kept since
    its first command), else ``--tokenizer``, else the ``tokenizer.json`` of an
    ``--init-from`` Hugging Face directory."""
    kept = Path(run_dir) / TOKENIZER_FILE
    if kept.is_file():
        return text.load_tokenizer(kept)
    if cfg.data.tokenizer is not None:
        return text.load_tokenizer(cfg.data.tokenizer)
    source = pretrained_source(cfg)
    if source is not None and (Path(source) / TOKENIZER_FILE).is_file():
        return text.load_tokenizer(source)
    return None


def pretrained_source(cfg: TrainConfig) -> Optional[str]:
    """The Hugging Face directory a run starts from: ``--init-from DIR``, or ``--model DIR``
    without ``--init-from`` (the directory's architecture and its weights)."""
    if cfg.init_from is not None:
        return cfg.init_from if is_pretrained_dir(cfg.init_from) else None
    return cfg.model if is_pretrained_dir(cfg.model) else None


def load_data(cfg: TrainConfig, tokenizer: Optional[text.TextTokenizer], vocab_size: int) -> datalib.TokenData:
    """The run's token stream, checked against the model's vocabulary.

    Raises ConfigError, in one line each: a tokenizer with more tokens than the model; text
    data without a tokenizer for a model that is not byte-level (vocabulary 256); a token
    file with ids outside the vocabulary.
    """
    model, source = cfg.model, cfg.data.data
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer.path} has {tokenizer.vocab_size:,} tokens, more than {model}'s vocabulary of "
            f"{vocab_size:,}: use the model's own tokenizer, or a model with a larger vocabulary"
        )
    is_text = text.is_text_source(source)
    if is_text and tokenizer is None and vocab_size != text.BYTE_VOCAB:
        raise ConfigError(
            f"{model} has a vocabulary of {vocab_size:,}, not bytes ({text.BYTE_VOCAB}): text data needs its "
            "tokenizer (--tokenizer tokenizer.json), or tokenize it once with nnxscale tokenize"
        )
    tokens = datalib.load_tokens(source, tokenizer=tokenizer if is_text else None)
    if tokens.vocab_size > vocab_size:
        raise ConfigError(
            f"data {source} holds token id {tokens.vocab_size - 1:,}, outside {model}'s vocabulary of {vocab_size:,} "
            f"(ids 0 to {vocab_size - 1:,}): tokenize it with the model's tokenizer"
        )
    return tokens


def _keep_tokenizer(tokenizer: text.TextTokenizer, run_dir: Path) -> None:
    """Copy the tokenizer (and its tokenizer_config.json) into the run directory, once."""
    if tokenizer.path == run_dir / TOKENIZER_FILE:
        return
    config = tokenizer.path.with_name(TOKENIZER_CONFIG_FILE)
    for source, name in ((config, TOKENIZER_CONFIG_FILE), (tokenizer.path, TOKENIZER_FILE)):  # tokenizer.json last
        if source.is_file():
            try:
                content = source.read_text()
            except OSError as e:
                raise storage_error("reading", source, e) from None
            _write_atomic(run_dir / name, content)


class _StopSignals:
    """SIGTERM and SIGINT (Ctrl-C) ask the run to stop cleanly: it saves, then returns.

    Installed first thing in :func:`train`, so a signal during the sharded init or the
    first compilation is a request like any other: Python's default, a KeyboardInterrupt
    raised inside XLA's compiler, ended the process in a segmentation fault at exit. A
    second signal stops at once, without saving (exit code 128 + signal): like ``kill
    -9``, after which a resume continues from the last complete checkpoint.
    """

    def __init__(self):
        self.signal: Optional[int] = None
        self._previous = {}

    def __bool__(self) -> bool:
        return self.signal is not None

    def __enter__(self) -> _StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: the caller handles interruption
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, _frame) -> None:
        if self.signal is not None:
            os._exit(128 + signum)
        self.signal = signum
        name = signal.Signals(signum).name
        os.write(2, f"\nnnxscale: {name}: stopping as soon as it is safe; {name} again stops at once, unsaved\n".encode())


class _SkipCounter:
    """The host's half of the divergence guard: counts the steps that the jitted step
    skipped (:func:`skip_nonfinite`); :meth:`check` stops the run after ``limit`` in a row."""

    def __init__(self, limit: int, total: int, lr: float, run_dir: Path):
        self.limit, self.total, self.lr, self.run_dir = limit, total, lr, run_dir
        self.streak = 0
        self.last_bad: tuple[int, dict] = (0, {})

    def seen(self, step: int, metrics: dict) -> None:
        """Account for ``step``'s metrics (host values)."""
        if not metrics["skipped"]:
            self.streak = 0
            return
        self.total += 1
        self.streak += 1
        self.last_bad = (step, metrics)

    def check(self, latest_checkpoint: Callable[[], Optional[int]]) -> None:
        """Raise DivergenceError if the last ``limit`` steps accounted for were all skipped."""
        if self.streak < self.limit:
            return
        step, metrics = self.last_bad
        bad = [f"{name} {metrics[key]}" for key, name in (("loss", "loss"), ("grad_norm", "gradient norm"))
               if not math.isfinite(metrics[key])]  # fmt: skip
        latest = latest_checkpoint()
        restart = f" (--init-from {self.run_dir} starts from its step {latest})" if latest is not None else ""
        raise DivergenceError(
            f"training diverged at step {step}: {' and '.join(bad)}, non-finite for {self.streak} steps in a row "
            f"(steps {step - self.streak + 1}-{step}), each skipped, so no parameter or checkpoint holds them; "
            f"try a lower --lr (this run: {self.lr:g}), more --warmup-steps or a --grad-clip in a new --run-dir{restart}"
        )


# --------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class TrainResult:
    run_dir: Path
    start_step: int
    final_step: int
    final_loss: Optional[float]
    val_loss: Optional[float]
    tokens_per_s: Optional[float]
    wall_s: float
    interrupted_by: Optional[int] = None  # signal number when stopped by SIGTERM/SIGINT
    skipped_steps: int = 0  # steps whose update was skipped (non-finite loss or gradient norm)


def train(
    cfg: TrainConfig,
    *,
    model: Optional[Callable[[nnx.Rngs], nnx.Module]] = None,
    loss: Optional[Callable] = None,
    mesh=None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> TrainResult:
    """Train (or resume) the run in ``cfg.run_dir``. Everything ``nnxscale train`` does.

    Args:
      cfg: the run's settings. ``cfg.rules`` may be your own rules string
        (``"batch=data,mlp=model,..."``).
      model: your own module instead of the preset ``cfg.model``: a function ``rngs ->
        nnx.Module`` (``lambda rngs: MyLM(..., rngs=rngs)``), called with ``nnx.Rngs(cfg.seed)``.
        The module maps ``(B, T)`` int tokens to ``(B, T, V)`` logits; ``cfg.model`` names it
        in the run directory. Checkpoints, resume (on any mesh) and ``cfg.init_from``
        another run of the module work as for a preset; ``cfg``'s dropout, dtype and remat
        are a preset's options and must stay at their defaults.
      loss: ``loss(model, inputs, targets, *, rngs) -> scalar`` instead of
        :func:`nnxscale.models.next_token_loss` (``rngs``: ``nnx.Rngs(dropout=key)`` in a
        training step, ``None`` in evaluation).
      mesh: a ``jax.sharding.Mesh`` instead of ``make_mesh(cfg.mesh)``.
      progress: draw a progress bar.
      log: where the run's lines go (resume, lint, weight decay, notes).

    Raises NnxscaleError subclasses for what a user can fix: bad settings
    (ConfigError), another trainer on the run directory (RunLockedError), a full or
    read-only disk (StorageError, CheckpointError), a run that diverged (DivergenceError).
    """
    with _StopSignals() as stop:
        return _train(cfg, stop, model=model, loss=loss, progress=progress, mesh=mesh, log=log)


def _train(cfg: TrainConfig, stop: _StopSignals, *, model, loss, progress: bool, mesh, log: Callable[[str], None]) -> TrainResult:
    t_start = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    cfg = _fix_schedule_length(cfg, run_dir)
    s = setup(cfg, mesh, model=model, loss=loss)
    is_main = jax.process_index() == 0

    # Data: tokens (text through the run's tokenizer), validation split, per-process iterators.
    tokenizer = run_tokenizer(cfg, run_dir)
    tokens = load_data(cfg, tokenizer, s.vocab_size())
    train_tokens, val_tokens = datalib.split(tokens.tokens, cfg.data.val_fraction)
    train_it = datalib.train_batches(
        train_tokens,
        seq_len=cfg.data.seq_len,
        global_batch_size=cfg.data.batch_size,
        seed=cfg.seed,
        sharding=s.batch_sharding,  # each process reads the rows its devices hold
    )
    val_batches = []
    if cfg.eval_every:
        if len(val_tokens) >= cfg.data.batch_size * (cfg.data.seq_len + 1):
            val_batches = datalib.eval_batches(
                val_tokens,
                seq_len=cfg.data.seq_len,
                global_batch_size=cfg.data.batch_size,
                max_batches=cfg.data.eval_batches,
                sharding=s.batch_sharding,
            )
        else:
            log(
                f"note: the validation split ({len(val_tokens)} tokens) is smaller than one batch "
                f"({cfg.data.batch_size} x {cfg.data.seq_len + 1}): no validation loss (raise --val-fraction)"
            )

    for finding in process_findings(s.mesh, current().hosts):  # tensor parallelism across hosts
        log(f"lint: {finding}")

    check_run_dir(cfg, run_dir)  # after validating the command itself, before writing anything
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error("creating the run directory", run_dir, e) from None
    # One trainer per run directory, from before its first write until after its last. As
    # the only writer, it deletes the saves that a crash left unfinished (freeing their
    # space) and the steps beyond --keep that a crash left behind.
    lock = RunLock(run_dir, warn=log)
    lock.acquire()
    try:
        ckpt = Checkpointer(checkpoint_dir(run_dir), keep=cfg.keep, remove_unfinished=True)
    except BaseException:
        lock.release()
        raise
    try:
        watch = ProgressWatchdog(
            timeout_from(cfg.hang_timeout), run_dir / "logs", process=jax.process_index(),
            resume_hint="Re-run the same command to resume from the last complete checkpoint.",
        )  # fmt: skip
    except ValueError as e:
        ckpt.close()
        lock.release()
        raise ConfigError(str(e)) from None
    try:  # the checkpointer's background threads must be closed on every path
        watch.__enter__()
        metrics_path = run_dir / "metrics.jsonl"
        skipped_before = 0
        if ckpt.steps():
            watch.phase("restoring the latest checkpoint", compiles=True, kind="save")
            start, state, extras = ckpt.restore_intact(s.abstract, warn=log, set_aside=True)
            watch.progress(f"restored step {start}")
            state = run_order(s, state)  # checkpoints hold layer order
            ckpt.remove_surplus()
            train_it.set_state(extras["data"])
            if extras.get("data_fingerprint") not in (None, tokens.fingerprint):
                raise ConfigError(f"the data in {tokens.description} changed since this run was saved")
            skipped_before = extras.get("skipped_steps", 0)
            if is_main:
                _repair_metrics(metrics_path, start)
            log(f"resumed {run_dir} from step {start} on mesh {format_mesh(s.mesh.shape)}")
        else:
            start = 0
            init_from = cfg.init_from or (pretrained_source(cfg) if model is None else None)
            watch.phase("initializing the model", compiles=True, kind="save")
            params = load_init_params(s, init_from, warn=log) if init_from else None
            state = init_state(s, params)
            if is_main:
                metrics_path.unlink(missing_ok=True)
        if is_main:
            saved = {"train": cfg.to_dict(), "model": s.model.describe(), "data": tokens.description}
            _write_atomic(run_dir / "config.json", json.dumps(saved, indent=2, sort_keys=True) + "\n")
            if tokenizer is not None:
                _keep_tokenizer(tokenizer, run_dir)
        log(describe_decay(s.decay_mask, s.abstract["params"], cfg.optim.weight_decay))
        if s.pipeline is not None:
            log(describe_pipeline(s))
            specs = [sh.spec for sh in jax.tree.leaves(s.param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))]
            for note in pipeline_notes(s.pipeline, s.rules, specs):
                log(f"lint: {note}")

        # A signal may reach one process only: every process stops at the step they agree on,
        # through a vote inside the step (read MAX_IN_FLIGHT steps later, when it is done).
        vote, stopping, agreed = StopVote(s.mesh), None, []
        step_fn = make_train_step(s, vote=True) if vote.needed else make_train_step(s)
        eval_fn = make_eval_step(s)
        tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        flops_per_token = s.flops_per_token()
        peak = peak_flops(jax.devices()[0])
        peak_total = peak * jax.device_count() if peak else None
        skips = _SkipCounter(cfg.max_bad_steps, skipped_before, cfg.optim.lr, run_dir)

        def evaluate(params) -> Optional[float]:
            # One batch at a time: evaluation programs are independent of each other, and two
            # with cross-process collectives in flight at once can deadlock (docs/multiprocess.md).
            if not val_batches:
                return None
            watch.phase(f"evaluating at step {step}", compiles=not evaluated, kind="eval")
            losses = [float(eval_fn(params, datalib.to_global(b, s.batch_sharding))) for b in val_batches]
            evaluated.append(step)
            watch.progress(f"evaluation at step {step}")
            return float(np.mean(losses))

        def account() -> None:
            """Account for the oldest step in flight, and for the stop vote it carries."""
            done, metrics = in_flight.popleft()
            watch.phase(f"training step {done}", compiles=done == start + 1)
            metrics = jax.device_get(metrics)
            now = time.perf_counter()
            watch.progress(f"step {done}", step_time=(now - completed[0]) / (done - completed[1]) if completed else None)
            completed[:] = [now, done]
            skips.seen(done, metrics)
            if metrics.get("stop"):  # the same on every process, seen at the same step
                agreed.append(int(metrics["stop"]))

        def settle() -> None:
            """Account for every step dispatched so far (they are done or nearly)."""
            while in_flight:
                account()

        def latest_saved() -> Optional[int]:
            ckpt.wait()
            return ckpt.latest_step()

        def save(step: int) -> None:
            settle()
            skips.check(latest_saved)
            extras = {"data": train_it.get_state(), "data_fingerprint": tokens.fingerprint, "config": cfg.to_dict(),
                      "skipped_steps": skips.total}  # fmt: skip
            watch.phase(f"saving step {step}", compiles=not saved, kind="save")
            ordered = saved_order(s, state)
            if ordered is not state:  # a program with collectives beside the step's chain: let it finish
                jax.block_until_ready(ordered)
            ckpt.save(step, ordered, extras, force=True)
            saved.append(step)
            watch.progress(f"save of step {step} (started)")

        completed: list = []  # (time, step) of the last step accounted for
        saved: list[int] = []
        evaluated: list[int] = []
        bar = ProgressBar(progress and is_main, "train", cfg.steps, completed=start)
        last_loss = last_val = tokens_per_s = None
        t_last, s_last = time.perf_counter(), start
        step = start
        # At most MAX_IN_FLIGHT steps are queued on the devices: enough to overlap host and
        # device, and XLA:CPU's in-process collectives deadlock with ~100 queued steps.
        in_flight: collections.deque = collections.deque()  # (step, metrics) not yet accounted for
        try:
            while step < cfg.steps and not stopping:
                batch = datalib.to_global(next(train_it), s.batch_sharding)
                with jax.set_mesh(s.mesh):
                    if vote.needed:
                        state, metrics = step_fn(state, batch, vote.ballot(stop.signal))
                    else:
                        state, metrics = step_fn(state, batch)
                step += 1
                in_flight.append((step, metrics))
                if len(in_flight) > MAX_IN_FLIGHT:
                    account()
                stopping = (agreed[0] if agreed else None) if vote.needed else stop.signal
                if step == start + 1:  # first step includes compilation; time from here on
                    jax.block_until_ready(metrics)
                    t_last, s_last = time.perf_counter(), step
                do_eval = bool(val_batches) and (step % cfg.eval_every == 0 or step == cfg.steps)
                if step % cfg.log_every == 0 or step == cfg.steps or do_eval or stopping:
                    settle()
                    if vote.needed and agreed:
                        stopping = agreed[0]
                    m = {k: float(v) for k, v in jax.device_get(metrics).items() if k not in ("skipped", "stop")}
                    now = time.perf_counter()
                    record = {"step": step, **m, "skipped_steps": skips.total}
                    if step > s_last:
                        dt = (now - t_last) / (step - s_last)
                        tokens_per_s = tokens_per_step / dt
                        record |= {"step_time_s": dt, "tokens_per_s": tokens_per_s,
                                   "tflops_per_s": tokens_per_s * flops_per_token / 1e12}
                        if peak_total:
                            record["mfu"] = tokens_per_s * flops_per_token / peak_total
                        t_last, s_last = now, step
                    if do_eval:
                        last_val = record["val_loss"] = evaluate(state["params"])
                        t_last = time.perf_counter()  # evaluation is not step time
                    last_loss = m["loss"]
                    if is_main:
                        _append_metrics(metrics_path, record)
                    bar.update(step, _progress_info(record))
                else:
                    bar.update(step)
                skips.check(latest_saved)  # nothing is saved, or run, once the run has diverged
                if stopping or step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                    save(step)
                    t_last = time.perf_counter()  # the host-side part of a save is not step time
        finally:
            bar.close()
            watch.phase("writing the last checkpoint", kind="save")
            ckpt.wait()
    finally:
        try:
            ckpt.close()
        finally:
            watch.__exit__(None, None, None)
            lock.release()
    if is_main:
        plot_metrics(run_dir)
    return TrainResult(
        run_dir=run_dir,
        start_step=start,
        final_step=step,
        final_loss=last_loss,
        val_loss=last_val,
        tokens_per_s=tokens_per_s,
        wall_s=time.perf_counter() - t_start,
        interrupted_by=stopping if step < cfg.steps else None,  # a signal after the last step stops nothing
        skipped_steps=skips.total,
    )


def _progress_info(record: dict) -> str:
    """The progress bar's text for a logged step: its loss, validation loss and speed."""
    info = f"loss {record['loss']:.3f}"
    if "val_loss" in record:
        info += f"  val {record['val_loss']:.3f}"
    if "tokens_per_s" in record:
        info += f"  {record['tokens_per_s']:,.0f} tok/s"
    return info


# --------------------------------------------------------------------------------------
# Seed checkpoints: nnxscale init
# --------------------------------------------------------------------------------------


def init_run(model: str, mesh_spec, run_dir, *, rules="auto", seed: int = 0, min_shard_bytes: Optional[int] = None) -> dict:
    """Create the preset ``model`` (of any family) in its sharded layout and save it as a seed checkpoint.

    Returns ``{"num_params", "total_bytes", "per_device_bytes", "mesh", "path"}``. Refuses a
    run directory that already holds checkpoints (nothing saved is overwritten).
    """
    run_dir = Path(run_dir)
    root = checkpoint_dir(run_dir)
    if root.exists() and any(root.iterdir()):
        raise ConfigError(f"{run_dir} already holds checkpoints; choose a new --run-dir")
    m = run_model(TrainConfig(model=model))
    mesh = make_mesh(mesh_spec)
    resolved = resolve(rules, mesh, min_shard_bytes=min_shard_bytes)
    created = sharded_init(lambda: m.build(nnx.Rngs(seed)), mesh, resolved)
    per_device, total = layout_bytes(created, mesh, resolved)
    params = _pure(nnx.state(created))
    del created
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error("creating the run directory", run_dir, e) from None
    with RunLock(run_dir), Checkpointer(root, async_save=False) as ckpt:
        ckpt.save(0, {"params": params}, {"kind": "seed", "model": model, "seed": seed}, force=True)
    return {
        "num_params": m.config.num_params(),
        "total_bytes": total,
        "per_device_bytes": per_device,
        "mesh": format_mesh(mesh.shape),
        "path": str(root),
    }
