"""Everything derived from a config before any array exists (:func:`setup`), and the run's initial state.

The trainer and the planner build a run with the same :func:`setup`. The train state is one
pytree of plain dicts, every leaf a sharded ``jax.Array``::

    {"params": {...}, "opt_state": optax state, "step": int32[], "key": uint32[2]}

and, under ``--objective dpo`` without LoRA, ``"reference"``: the frozen parameters the run
started from (a LoRA run's reference is its base with the adapters off: no second copy).

Parameters take the layout of the rules; the optimizer state takes the layout of the
parameter it belongs to (``optax.tree_map_params``); step and key are replicated. A LoRA
run (``--lora-rank``) trains its adapters only: ``"params"`` are the adapters and the
frozen weights are ``"base"`` (:mod:`nnxscale.training.adapters`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.checkpoint.checkpointer import Checkpointer, checkpoint_dir
from nnxscale.data import text as text
from nnxscale.layers import attention, fp8, quantize
from nnxscale.layers import lora as lora_layers
from nnxscale.layers.pipeline import Pipeline, manual_axes, to_layer_order, to_stage_order
from nnxscale.layers.stack import LAYERS
from nnxscale.models import (
    architecture_differences,
    is_pretrained_dir,
    pretrained_family,
)  # fmt: skip
from nnxscale.models.common.hf_checkpoint import transform_loaded
from nnxscale.sharding.activations import use_rules
from nnxscale.sharding.axes import DATA, EXPERT, STAGE, entry_axes
from nnxscale.sharding.mesh import format_mesh, make_mesh
from nnxscale.sharding.rules import MeshRules, resolve
from nnxscale.sharding.state import abstract_state, is_variable, sharded_init
from nnxscale.training import adapters as lora_state
from nnxscale.training.config import ConfigError, TrainConfig
from nnxscale.training.model import RunModel, run_model
from nnxscale.training.optimizer import decay_mask, make_optimizer
from nnxscale.training.preference import REFERENCE


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
    model_state: Any = None  # the model's nnx State: Variables (logical names) over sharded ShapeDtypeStructs
    # --quantize-base: ({state path: (n_in, n_out)} of the base weights stored quantized, scheme, compute dtype)
    quantized: Optional[tuple] = None

    @property
    def param_shardings(self):
        return self.state_shardings["params"]

    @property
    def num_params(self) -> int:
        """The model's parameters (a LoRA run's base and adapters alike)."""
        leaves = jax.tree.leaves(lora_state.model_params(self.abstract), is_leaf=quantize.is_quantized)
        return sum(math.prod(a.shape) for a in leaves)

    def vocab_size(self) -> int:
        """The model's vocabulary: its family's, or the last axis of its own module's logits
        (traced on a ``(1, seq_len)`` batch, nothing allocated)."""
        if self.model.dims is not None:
            return self.model.dims.vocab_size
        tokens = jax.ShapeDtypeStruct((1, self.cfg.data.seq_len), jnp.int32)
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            logits = jax.eval_shape(lambda p, x: nnx.merge(self.graphdef, p)(x), lora_state.model_params(self.abstract), tokens)
        return int(logits.shape[-1])

    def flops_per_token(self) -> int:
        """Training FLOPs per token at this run's sequence length: the family's formula, or
        6N for your own module (no attention term)."""
        if self.model.family is not None:
            return self.model.family.flops_per_token(self.model.config, self.cfg.data.seq_len)
        return 6 * self.num_params


def pure_dict(tree):
    """nnx State (Variables at the leaves) -> plain nested dict of the Variables' values."""
    return nnx.to_pure_dict(tree)


def check_shapes(cfg: TrainConfig, rules: MeshRules, model: RunModel) -> None:
    """The sequence fits the model's context, the batch splits over the mesh and micro-batches."""
    d = cfg.data
    if model.dims is not None and d.seq_len > model.dims.context:
        raise ConfigError(f"--seq-len {d.seq_len} is longer than {cfg.model.name}'s context of {model.dims.context} tokens")
    context = rules.length_shard_count
    if context > 1:
        axes = ",".join(f"{a}={rules.sizes[a]}" for a in rules.length_axes)
        if d.seq_len % context:
            raise ConfigError(
                f"--seq-len {d.seq_len} must be a multiple of {context}: the sequence is split {context} ways "
                f"(mesh axes {axes}); e.g. --seq-len {-(-d.seq_len // context) * context}"
            )
    n = rules.sizes.get(EXPERT, 1)
    if n > 1 and model.family is not None:
        experts = getattr(model.config, "num_local_experts", None)
        mesh = format_mesh(rules.sizes)
        if experts is None:
            raise ConfigError(
                f"mesh {mesh} has an '{EXPERT}' axis of {n}, which splits a mixture's experts, but {cfg.model.name} "
                f"({model.family.name}) has none: name that axis data (e.g. --mesh {mesh.replace(EXPERT + '=', DATA + '=')})"
            )
        if experts % n:
            fits = [d for d in range(2, experts + 1) if experts % d == 0]
            raise ConfigError(
                f"mesh axis {EXPERT}={n} does not divide {cfg.model.name}'s {experts} experts: each device holds "
                f"experts / {EXPERT} of them; choose {EXPERT} among {', '.join(map(str, fits))}"
            )
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
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)[0]
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
    (from :class:`~nnxscale.layers.pipeline.Pipeline`) fewer microbatches than stages."""
    sizes = rules.sizes
    mesh = format_mesh(sizes)
    if STAGE not in sizes:
        if cfg.parallel.microbatches is not None:
            n = math.prod(sizes.values())
            example = f"stage=2,data={n // 2}" if n % 2 == 0 and n > 1 else "stage=2,..."
            raise ConfigError(
                f"--microbatches {cfg.parallel.microbatches} asks for a pipeline, but mesh {mesh} has no '{STAGE}' axis to put "
                f"its stages on: add one (e.g. --mesh {example}), or drop --microbatches"
            )
        return None
    stages = sizes[STAGE]
    if cfg.parallel.microbatches is None:
        rows = cfg.data.batch_size // max(rules.batch_shard_count, 1)
        fits = [m for m in (2 * stages, stages, 4 * stages) if rows % m == 0] or [2 * stages]
        raise ConfigError(
            f"mesh {mesh} has a '{STAGE}' axis: its {stages} pipeline stages need --microbatches M, at least {stages} "
            f"and dividing the {rows} rows each batch shard holds (e.g. --microbatches {fits[0]}); "
            f"--pipeline-repeats R > 1 makes the schedule circular"
        )
    return Pipeline.for_mesh(sizes, cfg.parallel.microbatches, cfg.parallel.pipeline_repeats,
                             schedule=cfg.parallel.pipeline_schedule)  # fmt: skip


def check_pipeline(pipe: Pipeline, cfg: TrainConfig, rules: MeshRules, name: str, params) -> int:
    """The model has stacked layers the pipeline can split, and they and the batch fit it
    (:meth:`Pipeline.check`). ``params``: ``(shape, PartitionSpec)`` of every parameter.
    Returns the stacked depth; raises ConfigError in one line."""
    depths = sorted({int(shape[0]) for shape, spec in params if spec and STAGE in entry_axes(spec[0])})
    if not depths:
        raise ConfigError(
            f"{name} has no stacked layers for the {pipe.stages} pipeline stages of mesh {format_mesh(rules.sizes)}: "
            "a pipeline runs layers created with nnxscale.stack_layers and run with nnxscale.scan_layers "
            f"(the rules put their '{LAYERS}' axis on '{STAGE}' when the stages divide the stack; a layer pattern's "
            "groups count as one each, docs/models.md); train this model on a mesh without a stage axis"
        )
    for n in depths:  # each accumulation step's batch goes through the pipeline
        pipe.check(n, cfg.data.batch_size // cfg.optim.grad_accum, rules.batch_shard_count)
    return depths[-1]


def pipeline_notes(pipe: Pipeline, rules: MeshRules, specs, *, routed: bool = False) -> list[str]:
    """What to know about a pipeline beside the other mesh axes (``specs``: the parameters'
    PartitionSpecs): FSDP beside ``stage`` gathers every layer once per iteration (a
    mixture's expert axis does not: the stage is manual over it, :func:`manual_axes`).
    ``routed``: the model is a mixture of experts, whose tokens a stage routes per shard of
    its manual axes only."""
    used = {a for spec in specs for entry in spec for a in entry_axes(entry)}
    manual = manual_axes(specs, rules)
    fsdp = [a for a in rules.batch_axes if a in used and rules.sizes[a] > 1 and a not in manual]
    notes = []
    if fsdp:
        gathers = pipe.iterations / pipe.repeats
        notes.append(
            f"FSDP ({', '.join(fsdp)}) beside the stage axis: every pipeline iteration gathers its layers' weights and "
            f"reduce-scatters their gradients, so a step gathers each of a stage's layers {gathers:g} times "
            f"((R*M + S - 1)/R) where FSDP without a pipeline gathers it once; prefer data beside stage"
        )
    if routed and fsdp:
        notes.append(
            f"a mixture of experts in a pipeline stage routes its tokens per shard of {', '.join(manual) or 'no axis'}; "
            f"{', '.join(fsdp)} splits them too and the compiler moves them between its shards (more all-to-all): "
            "prefer data and expert beside stage"
        )
    return notes


# One function on purpose (about 90 lines with its docstring): every sharding of a run is derived here, in one order,
# for the trainer, the planner, `init` and `sample` alike.
def setup(
    cfg: TrainConfig,
    mesh=None,
    *,
    model: Optional[Callable] = None,
    loss: Optional[Callable] = None,
    recorded: Optional[dict] = None,
    separator: Optional[int] = None,
    ignored_targets: bool = False,
) -> Setup:
    """Validate ``cfg`` against the devices and build the sharded plan (no arrays yet).

    ``mesh``: a ``jax.sharding.Mesh`` (default ``make_mesh(cfg.parallel.mesh)``), or an
    ``AbstractMesh`` (axis names and sizes only) to plan for devices this machine does not
    have: the planner builds its runs here too.

    ``model`` and ``loss``: your own module instead of the preset ``cfg.model.name`` (see
    :func:`train`). ``recorded``: a run's record of its model (see :func:`model_architecture`).
    ``separator``: the token that ends a document, with ``cfg.data.document_mask``
    (:func:`nnxscale.training.inputs.document_separator`). ``ignored_targets``: the data
    marks targets the loss does not train (``--loss-on completion``).
    On a mesh with a ``stage`` axis the plan includes the pipeline
    (``Setup.pipeline``), checked against the model's depth and the batch here, before
    anything is allocated.
    """
    cfg.validate()
    mesh = make_mesh(cfg.parallel.mesh) if mesh is None else mesh
    rules = resolve(cfg.parallel.rules, mesh, min_shard_bytes=cfg.parallel.min_shard_bytes)
    m = run_model(cfg, model, loss, recorded=recorded, separator=separator, ignored_targets=ignored_targets)
    if m.fp8:
        fp8.check_devices(mesh)
    check_shapes(cfg, rules, m)
    pipe = run_pipeline(cfg, rules)
    if getattr(m.config, "attention", None):  # --attention cudnn where it cannot run: one line, before anything is built
        attention.resolve(m.config.attention, cfg.data.seq_len, m.config.dtype, m.dims.head_width, cfg.data.document_mask,
                          attention.platform_of(mesh), pipelined=pipe is not None)  # fmt: skip
    d = cfg.data

    factory = lambda: m.build(nnx.Rngs(cfg.seed))  # noqa: E731
    # A family's model is its config, adapters and seed, whatever the mesh (a sweep traces it once).
    key = None if m.family is None else (m.name, repr(m.config), repr(m.lora), m.fp8, cfg.seed)
    graphdef, abs_model_state = abstract_state(factory, mesh, rules, key=key)
    check_params_only(m, abs_model_state)
    param_sh = pure_dict(jax.tree.map(lambda v: v.replace(v.get_value().sharding), abs_model_state, is_leaf=is_variable))
    stacked = None
    if pipe is not None:
        shapes = jax.tree.leaves(pure_dict(abs_model_state))
        shardings = jax.tree.leaves(param_sh, is_leaf=lambda x: isinstance(x, NamedSharding))
        stacked = check_pipeline(pipe, cfg, rules, m.name, [(a.shape, sh.spec) for a, sh in zip(shapes, shardings)])
    mask = decay_mask(abs_model_state)
    base_sh = None
    if m.lora is not None:  # the adapters train; the base is frozen: no gradient, no optimizer state
        mask = lora_state.split_params(mask)[0]
        param_sh, base_sh = lora_state.split_params(param_sh)
    tx, schedule = make_optimizer(cfg, mask)
    abstract, state_sh, init_fn = _train_state(cfg, tx, pure_dict(abs_model_state), param_sh, mesh, base_sh,
                                               reference=m.reference and m.lora is None)  # fmt: skip
    quantized = None
    if m.lora is not None and cfg.lora.quantize_base is not None:  # QLoRA: the frozen layers' weights stored quantized
        targets = lora_layers.stacked_weights(nnx.merge(graphdef, abs_model_state))
        quantized = (targets, cfg.lora.quantize_base, jnp.dtype(cfg.model.dtype))
        abstract[lora_state.BASE] = quantize.quantize_abstract(abstract[lora_state.BASE], *quantized)
        state_sh[lora_state.BASE] = jax.tree.map(lambda a: a.sharding, abstract[lora_state.BASE])

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
        model_state=abs_model_state,
        quantized=quantized,
    )


def _train_state(cfg: TrainConfig, tx, abs_params, param_sh, mesh, base_sh=None, *, reference: bool = False):
    """``(abstract state, its shardings, init_fn)`` of the train state around ``abs_params``
    (ShapeDtypeStructs, so the model is not traced again): the optimizer state sharded like
    the parameters it belongs to, the step and the PRNG key replicated. ``base_sh``: a LoRA
    run's frozen base (its shardings): ``init_fn`` takes the model's parameters and keeps
    the base beside the adapters, outside the optimizer. ``reference`` (``--objective dpo``
    without LoRA): a frozen copy of the starting parameters, laid out like them
    (:mod:`nnxscale.training.preference`)."""
    replicated = NamedSharding(mesh, P())

    def state_from(params):
        base = None
        if base_sh is not None:
            params, base = lora_state.split_params(params)
        state = {
            "params": params,
            "opt_state": tx.init(params),
            "step": jnp.zeros((), jnp.int32),
            "key": jax.random.key_data(jax.random.key(cfg.seed)),
        }
        if reference:
            state[REFERENCE] = jax.tree.map(jnp.copy, params)
        return state if base is None else {**state, lora_state.BASE: base}

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
    if reference:
        state_sh[REFERENCE] = param_sh
    if base_sh is not None:
        state_sh[lora_state.BASE] = base_sh
    abstract = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abs_state, state_sh)
    return abstract, state_sh, state_from


def init_state(setup: Setup, params=None, *, log: Optional[Callable[[str], None]] = None):
    """Create the train state directly in its sharded layout (or around given params), in
    the order the step runs it (:func:`run_order`). A LoRA run's given params are its base:
    fresh adapters join them."""
    if params is None:  # the one sharded-init path, shared with `nnxscale init`
        abstract = (setup.graphdef, setup.model_state)
        params = pure_dict(nnx.state(sharded_init(setup.factory, setup.mesh, setup.rules, abstract=abstract)))
    elif setup.model.lora is not None:
        params = lora_state.merge_params(params, lora_state.init_adapters(setup))
    if setup.quantized is not None:  # each frozen weight quantized where it lies, before the state is built around it
        params = quantize.quantize_params(params, *setup.quantized, log=log)
    with jax.set_mesh(setup.mesh):
        state = jax.jit(setup.init_fn, out_shardings=setup.state_shardings, donate_argnums=0)(params)
    return run_order(setup, state)


def run_order(setup: Setup, state, *, donate: bool = True):
    """A train state in layer order (created, restored) -> the order the step runs it.

    For the circular pipeline that is stage order (:func:`nnxscale.layers.pipeline.to_stage_order`,
    parameters and optimizer moments alike, once per init or restore); otherwise the state
    itself. ``donate``: the layer-order state is used up.
    """
    if setup.pipeline is None or setup.pipeline.repeats == 1:
        return state
    return to_stage_order(state, setup.pipeline, setup.state_shardings, donate=donate)


def saved_order(setup: Setup, state):
    """The inverse of :func:`run_order`, for what leaves the run: checkpoints are always in
    layer order, so they move between pipelined and unpipelined meshes. ``state`` is kept
    (the circular pipeline's copy costs one more stacked state of memory while it is saved)."""
    if setup.pipeline is None or setup.pipeline.repeats == 1:
        return state
    return to_layer_order(state, setup.pipeline, {k: setup.state_shardings[k] for k in state})


_SCHEDULE_NAMES = {"gpipe": "GPipe", "circular": "circular", "1f1b": "1F1B"}


def describe_pipeline(setup: Setup) -> str:
    """One line: the run's pipeline layout (schedule, layers per stage, microbatches, bubble)."""
    p, n = setup.pipeline, setup.stacked_layers
    rows = setup.cfg.data.batch_size // (setup.rules.batch_shard_count * p.microbatches)
    groups = f", {p.repeats} groups of {n // (p.stages * p.repeats)} per stage" if p.repeats > 1 else ""
    return (
        f"pipeline: {_SCHEDULE_NAMES[p.schedule]} over {p.stages} stages, {n // p.stages} of {n} layers "
        f"per stage{groups}; {p.microbatches} microbatches of {rows} rows per batch shard, "
        f"{p.iterations} iterations a pass, bubble {p.bubble:.1%}"
    )




def load_init_params(setup: Setup, source: str, *, warn: Callable[[str], None] = print):
    """Parameters from a seed checkpoint (``nnxscale init``, any run directory) or a Hugging
    Face directory of the run's family, in this run's layout and parameter dtypes.

    From a run directory: its newest intact checkpoint (``warn`` names damaged newer ones).
    From a Hugging Face directory: its architecture must be the preset's; dropout, compute
    dtype and remat are this run's own, and weights stored in another dtype (bfloat16) are
    cast to this run's.
    """
    path = Path(source)
    if is_pretrained_dir(path) and not checkpoint_dir(path).exists():
        family, m = pretrained_family(path), setup.model
        if m.family is None:
            raise ConfigError(
                f"--init-from {path} is a Hugging Face {family.name} directory, but this run trains your own module "
                "(model=): start it from a seed checkpoint of that module, or train a preset"
            )
        if family is not m.family:
            raise ConfigError(f"--init-from {path} holds a {family.name} model, but --model {m.name} is a {m.family.name} preset")
        # --quantize-base: each weight quantized as it is read (from the checkpoint's dtype)
        quantizer = None if setup.quantized is None else quantize.Quantizer(*setup.quantized)
        with contextlib.nullcontext() if quantizer is None else transform_loaded(quantizer):
            model = family.from_pretrained(path, mesh=setup.mesh, rules=setup.rules)
        if differences := architecture_differences(family, model.config, m.config):
            raise ConfigError(f"--init-from {path} is not the architecture of --model {m.name} ({'; '.join(differences)})")
        if quantizer is not None:
            quantizer.report(warn)
        params = pure_dict(nnx.state(model))
        wanted = _model_abstract(setup)

        def cast(a, want):
            return a if quantize.is_quantized(a) or a.dtype == want.dtype else a.astype(want.dtype)

        return jax.tree.map(cast, params, wanted, is_leaf=quantize.is_quantized)
    ckpt_root = checkpoint_dir(path)
    if not ckpt_root.exists():
        raise ConfigError(
            f"--init-from {path}: neither a Hugging Face model directory (config.json + model.safetensors) "
            "nor an nnxscale run directory with checkpoints"
        )
    with Checkpointer(ckpt_root, async_save=False) as ckpt:
        _, restored, _ = ckpt.restore_intact({"params": _model_abstract(setup)}, warn=warn, part=True)
    return restored["params"]


def _model_abstract(setup: Setup):
    """What a seed checkpoint or a Hugging Face directory gives a run: its parameters, or a
    LoRA run's base."""
    return setup.abstract.get(lora_state.BASE, setup.abstract["params"])
