"""The 1F1B pipeline schedule: a loss and its gradients whose memory does not grow with M.

GPipe (:mod:`nnxscale.layers.pipeline`) is a forward scan that JAX differentiates: every
stage keeps what the backward pass needs of *every* microbatch until the backward begins,
so at a fixed microbatch size its memory grows linearly with ``M``. In 1F1B each stage runs
the backward pass of a microbatch as soon as the loss's gradient reaches it, so a stage
holds at most ``2(S-1-s)+1`` microbatches in flight, whatever ``M`` is.

That needs each microbatch's loss gradient while later microbatches are still going
forward, so here the whole loss (embedding, stacked layers, head and loss) runs inside the
schedule, one microbatch at a time, and the function computes the loss *and* its gradients
itself (:func:`pipeline_value_and_grad`); the training step uses them in place of
``jax.value_and_grad``. Model code does not change: the model's loss is called per
microbatch twice over, once with :func:`~nnxscale.scan_layers` replaced by a function that
records its input (the *prefix*: embedding, positions, dropout keys) and once with it
replaced by a given output (the *tail*: final norm, head, loss); what each does not use is
dead code that XLA removes.

**The schedule.** One ``jax.shard_map``, manual over ``stage`` and the batch axes that split
no stacked parameter (as GPipe's), runs ``M + 2S - 2`` ticks: stage ``s`` runs the forward
pass of microbatch ``t - s`` and the backward pass of microbatch ``t - 2(S-1) + s`` at tick
``t``. Within a tick every stage first runs its forward (stage 0 on the prefix's output,
the others on what their upstream neighbour sent last tick), the last stage's output goes
through the tail (its loss and the cotangent of its output, weighted as the whole batch's
mean weighs that microbatch), then every stage runs its backward: without remat ``jax.vjp`` of its layers recomputed
from the stored stage input; under a remat policy the pullback the forward tick made,
whose residuals (what the policy saves: under ``full`` each layer's input) waited in the
ring. Weight gradients are summed into a carry as they are made, the
input's cotangent sent upstream with one ``ppermute`` (stage 0's goes through the prefix's
``jax.vjp`` into the embedding's gradient). The first ``S-1`` ticks run forwards only and
the last ``S-1`` backwards only (three scans, each compiled once: compile time does not
grow with ``M``), so a step costs ``(M + S - 1)`` forward and backward passes, GPipe's
bubble ``(S-1)/(M+S-1)``, plus, without remat, one extra forward per microbatch for the
recomputation. Every collective of a tick depends on the one before it through data
(:func:`_tie`), so that every device runs them in one order.

**Interleaved** (``repeats=R > 1``): the circular schedule's layout (stage order,
:meth:`~nnxscale.layers.pipeline.Pipeline.layer_order`: stage ``s`` holds groups
``s, s+S, ...`` of ``L/(S*R)`` layers), so checkpoints and the state's order are the
circular schedule's. A work item is one microbatch through one group. Stage ``s`` runs the
forward of item ``k = t - s`` at tick ``t``, the items in blocks of ``S*R``: microbatches
``qS .. qS+S-1`` through repeat 0, the same ones through repeat 1, and so on (Megatron's
order; ``M`` must be a multiple of ``S``). What stage ``S-1`` finishes reaches stage 0
through the ring's wrap-around permute one tick later, exactly when stage 0 runs that
microbatch's next repeat: no buffer. The backward pass runs the same blocks with the
repeats reversed, ``S*R - 1`` ticks behind, and the cotangents wrap from stage 0 to
stage ``S-1``. ``R*M + S*R + S - 2`` ticks in three scans (``S*R - 1`` fill, ``S*R - 1``
drain), the bubble ``(S-1)/(R*M+S-1)`` as circular's. Only the ticks where stage ``S-1``
ends a microbatch's last repeat run the head and loss, and only those where stage 0's
backward item is a first repeat run the embedding's gradient (a ``cond`` on the tick,
the same on every device).

**Memory.** A stage keeps a ring of ``2SR-1`` slots (:func:`ring_slots`: stage inputs of
one group, or the remat policy's residuals; SPMD gives every stage the ring stage 0
needs), one item's backward pass at a time, and its gradients: nothing grows with ``M``
but the step's token arrays.

**A mixture of experts.** The router's load-balancing loss is ``E sum_e f_e P_e`` per
layer, ``f`` and ``P`` means over the whole batch, so no microbatch's backward knows its
gradient before every microbatch has been routed. The step first runs a forward pass of
every work item (``R*M + S - 1`` ticks, each a group's layers and one permute, no head,
nothing kept but the statistics) and averages each layer's statistics over the
microbatches and batch shards: the whole batch's, which the tail then gives the loss (so
the router losses and expert load reported are the unpipelined step's). The loss's
gradient with respect to them is taken once; the backward of item ``(m, j)`` adds
``1/(M*J)`` of it as the cotangent of its group's statistics (they are means over equal
parts). The cost: one more forward pass of the layers and a second bubble of ``S-1``
forward ticks (mixtral-mini on ``stage=2,expert=4``, M=4: a step 1.14x GPipe's,
``bench/pipeline.py --interleaved``). An ``expert`` axis beside ``stage`` is manual here
as in GPipe; the experts' gradients are not summed over it (each device has all of its
experts' tokens).

**LoRA** (``base=``): only the adapters train. Every ``jax.vjp`` here (a stage's, the
prefix's, the tail's) takes the trained leaves alone as its argument and closes over the
frozen base, so no gradient of the base is computed and the carry of weight gradients is
shaped like the adapters. A pullback keeps what it closes over as residuals, the base's
weights among them; the ring stores only the leaves that are neither the stage's trained nor
its frozen weights (told by identity, as the trained ones are), and the backward tick puts
its own group of both back: the ring holds what it holds without LoRA, whatever the base.
When only the stacked layers are adapted (the default targets), nothing outside them trains
and the prefix's ``vjp`` (the embedding's gradient) is left out.

**Exactness.** The loss is the weighted sum over (microbatch, batch shard) of each one's
mean loss, each weighted by its share of the tokens the loss counts (all of them, or with
``separator`` those whose input is not the separator): the unpipelined loss, as gradient
accumulation splits it. Dropout keys: the model draws from ``fold_in(key, m*J + j)`` for
microbatch ``m`` in batch shard ``j`` of ``J``, so masks differ from an unpipelined step's
(their distribution does not).

Stacks made with ``stack_layers(..., pipelined=False)`` (DeepSeek's dense first layers,
what is left of Gemma 3's last group) run whole on every stage, in the prefix or the tail:
the prefix's and tail's ``jax.vjp`` give their gradients as they give the embedding's.

Not supported, refused with a :class:`~nnxscale.errors.ConfigError`: more than one pipelined
stack of layers run by :func:`~nnxscale.scan_layers` in the loss; a mixture's layers outside
it (their load balancing would be per microbatch); interleaved with ``M`` not a multiple of ``S``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnxscale.errors import ConfigError
from nnxscale.layers import attention
from nnxscale.layers.lora import merge_params
from nnxscale.layers.pipeline import manual_layout, mesh_for, without_pipeline
from nnxscale.layers.stack import Rows, is_pipelined, layers_run_by, remat_policy, scan_state
from nnxscale.layers.token_weights import trained_weights
from nnxscale.sharding.activations import current_rules
from nnxscale.sharding.axes import entry_axes
from nnxscale.sharding.mesh import context_mesh, sum_to_type, vary, varying_axes, varying_like

__all__ = ["pipeline_value_and_grad", "ring_slots"]


def ring_slots(stages: int, repeats: int = 1) -> int:
    """Work items (stage inputs, or a remat policy's residuals) a stage keeps in 1F1B:
    ``2SR - 1``. An item waits ``2S(R-1-r) + 2(S-1-s)`` ticks on stage ``s`` in repeat ``r``
    between its forward and its backward tick, one item per tick; SPMD gives every stage
    the ring stage 0 needs. ``R = 1``: ``2S - 1``."""
    return 2 * stages * repeats - 1


@dataclasses.dataclass
class _Found:
    """What the model's loss hands :func:`~nnxscale.scan_layers`, found by tracing it once."""

    path: Optional[tuple] = None  # where the stacked layers sit in the model
    graphdef: Any = None  # their graphdef
    remat: Any = "none"  # the policy the model asks for
    stats: Any = None  # a mixture's router statistics, ShapeDtypeStructs stacked over the layers (aux=True)
    calls: int = 0


def _key_path(kp) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in kp)


def _call(objective, graphdef, params, inputs, targets, key, runner):
    """``(loss, extras)`` of ``objective`` with the pipelined stack's :func:`scan_layers` run by
    ``runner``; a stack made with ``stack_layers(..., pipelined=False)`` scans as it would
    unpipelined (in the prefix when it comes before the pipelined stack, in the tail after)."""
    model = nnx.merge(graphdef, params)

    def run(layers, x, *args, keys=None, remat="none", aux=False):  # what scan_layers calls
        if not is_pipelined(layers):
            if aux:  # its load-balancing loss would be a microbatch's, not the whole batch's
                raise ConfigError(
                    "--pipeline-schedule 1f1b: a mixture's layers outside the pipelined stack would balance their "
                    "experts per microbatch; use --pipeline-schedule gpipe"
                )
            layer_def, state = nnx.split(layers)
            x = varying_like(x, state)  # the scan's carry varies as the layers' output will
            return scan_state(layer_def, state, x, *(a.value if isinstance(a, Rows) else a for a in args), keys=keys,
                              remat=remat)  # fmt: skip
        return runner(model, layers, x, *args, keys=keys, remat=remat, aux=aux)

    with layers_run_by(run):
        out = objective(model, inputs, targets, rngs=None if key is None else nnx.Rngs(dropout=key))
    return out if isinstance(out, tuple) else (out, {})


def _discover(objective, graphdef, params, inputs, targets, key) -> _Found:
    found = _Found()

    def record(model, layers, x, *args, keys=None, remat="none", aux=False):
        found.calls += 1
        if found.calls > 1:
            raise ConfigError(
                "--pipeline-schedule 1f1b runs one pipelined stack of layers per loss, and this model's loss runs "
                "nnxscale.scan_layers on more than one (make the others with stack_layers(..., pipelined=False)); use "
                "--pipeline-schedule gpipe"
            )
        found.path = next((tuple(p) for p, node in nnx.iter_graph(model) if node is layers), None)
        found.graphdef, state = nnx.split(layers)
        found.remat = remat
        if not aux:
            return jnp.zeros_like(x)
        _, stats = scan_state(found.graphdef, state, x, *(a.value if isinstance(a, Rows) else a for a in args), keys=keys,
                              remat=remat, aux=True)  # fmt: skip
        found.stats = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stats)
        return jnp.zeros_like(x), stats

    jax.eval_shape(lambda p, x, y, k: _call(objective, graphdef, p, x, y, k, record)[0], params, inputs, targets, key)
    if found.calls == 0:
        raise ConfigError(
            "--pipeline-schedule 1f1b: the model's loss runs no stacked layers (nnxscale.scan_layers) for the stages"
        )
    if found.path is None:
        raise ConfigError("--pipeline-schedule 1f1b: the stacked layers the loss runs are not part of the model")
    return found


def pipeline_value_and_grad(
    objective: Callable,
    graphdef,
    params,
    inputs,
    targets,
    key,
    *,
    pipeline,
    base=None,
    mesh=None,
    separator: Optional[int] = None,
    ignored_targets: bool = False,
):
    """``((loss, extras), grads)`` of ``objective(nnx.merge(graphdef, params), inputs, targets,
    rngs=)`` computed by the 1F1B schedule: what ``jax.value_and_grad(..., has_aux=True)``
    of the unpipelined loss gives, to float tolerance (see the module docstring).

    Args:
      objective: the model's loss, ``(model, inputs, targets, *, rngs) -> scalar`` (or
        ``(scalar, extras)``), a mean over the tokens it counts; it runs the stacked layers
        with :func:`~nnxscale.scan_layers` once.
      graphdef, params: the model, split; the stacked layers laid out over ``pipeline.axis``.
      inputs, targets: ``(B, T)``; ``B`` splits into the batch shards and each shard's
        rows into ``pipeline.microbatches`` (microbatch ``m``: rows ``m, m+M, ...``).
      key: the step's dropout key, or ``None``.
      base: a LoRA run's frozen weights (``params`` are its adapters, the model's parameters
        ``merge_params(base, params)``), or ``None``. The schedule differentiates ``params``
        alone and closes over the base: no gradient of it is computed or carried, and the
        remat policy's residuals in the ring never hold its weights.
      pipeline: a :class:`~nnxscale.layers.pipeline.Pipeline`; with ``repeats > 1`` the
        stacked layers are in its stage order (:func:`~nnxscale.layers.pipeline.to_stage_order`).
      mesh: the mesh (default: as :func:`~nnxscale.layers.pipeline.use_pipeline` finds it).
      separator: the loss counts only tokens whose input is not ``separator``
        (``--document-mask``); ``None``: every token.
      ignored_targets: nor those whose target is ``IGNORED`` (``--loss-on completion``).

    Must be traced under the run's rules (:func:`nnxscale.use_rules`).
    """
    mesh = mesh_for(pipeline, mesh)
    rules = current_rules()
    merge = _merger(base)
    whole = merge(base, params)  # every parameter of the model
    found = _discover(objective, graphdef, whole, inputs, targets, key)

    # The parameters: the stacked layers (split over the stages) and the rest (replicated over
    # them), of the trained ones and of a LoRA run's frozen base each.
    trained, frozen = _Parts(params, found.path), _Parts({} if base is None else base, found.path)
    stacked = trained.stack + frozen.stack
    n_layers = int(stacked[0].shape[0])
    pipeline.check(n_layers, inputs.shape[0], rules.batch_shard_count if rules is not None else 1)
    data, specs = manual_layout(_sub_tree(whole, found.path), rules, pipeline.axis)
    stack_specs, frozen_specs = (part.specs(specs, whole, found.path) for part in (trained, frozen))

    def rebuild(stack, rest, fstack, frest):
        return merge(frozen.tree(fstack, frest), trained.tree(stack, rest))

    program = _Program(objective, graphdef, found, pipeline, data, (separator, ignored_targets), rebuild, merge,
                       (trained, frozen), stack_specs)  # fmt: skip
    rows = P(data) if data else P()
    run = jax.shard_map(
        program,
        mesh=context_mesh(mesh),
        in_specs=(stack_specs, [P()] * len(trained.rest), frozen_specs, [P()] * len(frozen.rest), rows, rows, P()),
        out_specs=(P(), P(), stack_specs, [P()] * len(trained.rest)),
        axis_names=frozenset((pipeline.axis,) + data),
    )
    # The loss's own stacks (none here) would run unpipelined.
    with without_pipeline(), attention.in_pipeline_stages():
        loss, extras, g_stack, g_rest = run(trained.stack, trained.rest, frozen.stack, frozen.rest, inputs, targets, key)
    return (loss, extras), trained.tree(g_stack, g_rest)


def _merger(base) -> Callable:
    """``merge(frozen, trained)``: the model's parameters from a LoRA run's frozen base and its
    adapters (:func:`nnxscale.layers.lora.merge_params`); without a base, ``trained``."""
    if base is None:
        return lambda frozen, trained: trained
    return merge_params


class _Parts:
    """The leaves of a tree of parameters as those of the stacked layers at ``path`` and the rest."""

    def __init__(self, tree, path: tuple):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.path, self.paths = path, [_key_path(kp) for kp, _ in flat]
        self.in_stack = [p[: len(path)] == path for p in self.paths]
        self.stack = [a for (_, a), s in zip(flat, self.in_stack) if s]
        self.rest = [a for (_, a), s in zip(flat, self.in_stack) if not s]

    def tree(self, stack, rest):
        it_s, it_r = iter(stack), iter(rest)
        return jax.tree.unflatten(self.treedef, [next(it_s) if s else next(it_r) for s in self.in_stack])

    def layers(self, stack) -> dict:
        """The stacked layers' part of the tree (their paths inside the stack); ``{}`` if none."""
        return _sub_tree(self.tree(stack, [None] * len(self.rest)), self.path) if stack else {}

    def specs(self, specs, whole, path: tuple) -> list:
        """The in_specs of the stacked leaves: ``specs`` (of the stacked layers of ``whole``, all
        parameters) is one spec for every leaf or a tree of them in ``whole``'s leaf order."""
        if isinstance(specs, P):
            return [specs] * len(self.stack)
        where = [_key_path(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(_sub_tree(whole, path))[0]]
        by_path = dict(zip(where, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))))
        return [by_path[p[len(path):]] for p, s in zip(self.paths, self.in_stack) if s]


def _sub_tree(params, path: tuple):
    """The part of ``params`` at ``path`` (the stacked layers')."""
    node = params
    for k in path:
        node = node[k]
    return node


class _Program:
    """What every device runs of the 1F1B step (inside ``shard_map``): the model's loss and
    where its stacked layers sit, the schedule, and the parameters' parts. A call traces one
    device's :class:`_Stage` and runs the :class:`_Schedule` on it."""

    def __init__(self, objective, graphdef, found, pipeline, data, masks, rebuild, merge, parts, stack_specs):
        self.objective, self.graphdef, self.found, self.pipe = objective, graphdef, found, pipeline
        self.data, self.masks, self.rebuild, self.merge = data, masks, rebuild, merge
        self.trained, self.frozen = parts  # the trained parameters' _Parts and a LoRA base's
        self.stack_specs = stack_specs
        # Without remat the backward tick recomputes the stage from its input (one
        # microbatch's activations at a time); with a remat policy the forward tick's
        # pullback keeps what the policy saves (under "full" each layer's input) in the ring.
        self.keep_residuals = remat_policy(found.remat) != "none"

    def __call__(self, stack, rest, fstack, frest, inputs, targets, key):
        stage = _Stage(self, stack, rest, fstack, frest, inputs, targets, key)
        return _Schedule(self, stage).run()

    def sum_over_batch(self, g_stack):
        """Each stacked gradient summed over the batch axes its weight is not split over
        (a mixture's experts are split over ``expert``: each device has all their tokens'
        gradient already), one ``psum`` per set of axes, one after another."""
        by_axes = {}
        for i, spec in enumerate(self.stack_specs):
            split = {a for e in spec for a in entry_axes(e)}
            by_axes.setdefault(tuple(a for a in self.data if a not in split), []).append(i)
        out, before = list(g_stack), ()
        for axes, idx in by_axes.items():
            if axes:
                summed = jax.lax.psum(_tie([out[i] for i in idx], *before), axes)
                for i, v in zip(idx, summed):
                    out[i] = v
                before = (summed,)
        return out


class _Stage:
    """One device's stage (inside ``shard_map``): its groups of layers, its microbatches and
    their weights in the loss, and the model's loss around the layers, run one microbatch
    (or, for the layers, one work item) at a time."""

    def __init__(self, program: _Program, stack, rest, fstack, frest, inputs, targets, key):
        pipe, data = program.pipe, program.data
        S, M, R, axis = pipe.stages, pipe.microbatches, pipe.repeats, pipe.axis
        manual = (axis,) + data
        self.program, self.found, self.key = program, program.found, key
        self.S, self.M, self.R, self.V, self.axis, self.data, self.manual = S, M, R, S * R, axis, data, manual
        self.aux = program.found.stats is not None
        self.s = jax.lax.axis_index(axis)
        self.shard = jax.lax.axis_index(data) if data else 0
        self.shards = math.prod(jax.lax.axis_size(a) for a in data)
        # Sums over the manual axes happen once, at the end: the parameters vary over them here.
        # A LoRA base is closed over by every vjp, never differentiated: (f)stack, (f)rest.
        self.stack, self.fstack = vary(stack, data), vary(fstack, data)
        self.rest, self.frest = vary(rest, manual), vary(frest, manual)
        layers, flayers = program.trained.layers(self.stack), program.frozen.layers(self.fstack)
        self.n_local = int(jax.tree.leaves((layers, flayers))[0].shape[0])  # R*L/(S*R) layers on this stage
        self.n_item = self.n_local // R  # the layers of one group: one work item's
        # Stage order (Pipeline.layer_order) puts layer j of repeat r at j*R + r: a free
        # reshape to (L/(S*R), R, ...) from which each work item picks its repeat's group.
        by_repeat = lambda a: a.reshape((self.n_item, R) + a.shape[1:])  # noqa: E731
        self.grouped = layers if R == 1 else jax.tree.map(by_repeat, layers)
        self.fgrouped = flayers if R == 1 else jax.tree.map(by_repeat, flayers)
        split = lambda a: a.reshape((a.shape[0] // M, M) + a.shape[1:]).swapaxes(0, 1)  # noqa: E731  (M, b, T)
        self.inputs, self.targets = split(inputs), split(targets)
        self.weights = self._microbatch_weights()  # (M,)

    def _microbatch_weights(self):
        """Each (microbatch, shard)'s weight in the mean: its share of the tokens the loss counts."""
        token_weights = trained_weights(self.inputs, self.targets, *self.program.masks)
        if token_weights is None:
            counts = jnp.ones((self.M,), jnp.float32)
        else:
            counts = jnp.sum(token_weights, axis=(1, 2))
        total = jax.lax.psum(jnp.sum(counts), self.data) if self.data else jnp.sum(counts)
        return vary(counts / total, self.manual)

    def group(self, r):
        """The trained weights of repeat ``r``'s group."""
        return self._of_repeat(self.grouped, r)

    def frozen_group(self, r):
        """A LoRA base's weights of repeat ``r``'s group (``{}`` without a base)."""
        return self._of_repeat(self.fgrouped, r)

    def _of_repeat(self, grouped, r):
        if self.R == 1:
            return grouped
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, axis=1, keepdims=False), grouped)

    def pick(self, a, m):
        """Microbatch ``m``'s entry of ``a`` (``m`` clipped: a bubble's item reads a real one)."""
        return jax.lax.dynamic_index_in_dim(a, jnp.clip(m, 0, self.M - 1), keepdims=False)

    def micro_key(self, m):
        """Microbatch ``m``'s dropout key in this batch shard: ``fold_in(key, m*J + j)``."""
        if self.key is None:
            return None
        return jax.random.fold_in(self.key, jnp.clip(m, 0, self.M - 1) * self.shards + self.shard)

    def prefix(self, rest_leaves, m):
        """``(x, (args, keys))``: the stacked layers' input for microbatch ``m`` and their arguments."""
        got = {}
        stats = self.found.stats

        def record(model, lay, x, *args, keys=None, remat="none", aux=False):
            got["args"] = tuple(a.value if isinstance(a, Rows) else a for a in args)
            got["keys"] = keys
            got["x"] = x
            return (jnp.zeros_like(x), _zeros(stats)) if aux else jnp.zeros_like(x)

        self._loss(rest_leaves, m, record)
        return got["x"], (got["args"], got["keys"])

    def tail(self, rest_leaves, y, m, stats):
        """``(loss, extras)`` of microbatch ``m`` whose stacked layers gave ``y`` (and, for a
        mixture, the statistics ``stats``)."""

        def given(model, lay, x, *args, keys=None, remat="none", aux=False):
            if x.shape != y.shape:
                raise ConfigError(f"1f1b: the stacked layers' input {x.shape} is not their output {y.shape}")
            return (y, stats) if aux else y

        return self._loss(rest_leaves, m, given)

    def _loss(self, rest_leaves, m, runner):
        """The model's loss on microbatch ``m``, its stacked layers run by ``runner``."""
        p = self.program
        params = p.rebuild(self.stack, rest_leaves, self.fstack, self.frest)
        return _call(p.objective, p.graphdef, params, self.pick(self.inputs, m), self.pick(self.targets, m),
                     self.micro_key(m), runner)  # fmt: skip

    def run_group(self, layer_state, h, args, keys, r, frozen):
        """The group of repeat ``r`` (trained weights ``layer_state``, a LoRA base's ``frozen``)
        on ``h``: its output (and with ``aux`` its statistics)."""
        return scan_state(self.found.graphdef, self.program.merge(frozen, layer_state), h, *args,
                          keys=self._group_keys(keys, r), remat=self.found.remat, aux=self.aux)  # fmt: skip

    def _group_keys(self, keys, r):
        if keys is None:
            return None
        return jax.lax.dynamic_slice_in_dim(keys, (r * self.S + self.s) * self.n_item, self.n_item)

    def group_vjp(self, h, args, keys, r):
        """The group's ``jax.vjp`` (over its trained weights and input) as its output, its
        pullback's leaves and structure, and which leaves are residuals: those that are not
        the stage's weights, trained or frozen (the backward tick has its own of those)."""
        weights, frozen = self.group(r), self.frozen_group(r)
        weight_ids = {id(a) for a in jax.tree.leaves((weights, frozen))}
        out, pullback = jax.vjp(lambda st, hh: self.run_group(st, hh, args, keys, r, frozen), weights, h)
        leaves, structure = jax.tree.flatten(pullback)
        return out, leaves, structure, tuple(i for i, a in enumerate(leaves) if id(a) not in weight_ids)


class _Schedule:
    """The 1F1B loop on one device: which work item each tick runs, the state carried from
    tick to tick (the ring, the gradients, the loss), each tick's forward and backward with
    what they send the neighbouring stages, and the sums over the devices at the end."""

    def __init__(self, program: _Program, stage: _Stage):
        self.program, self.stage = program, stage
        S, manual = stage.S, stage.manual
        self.K = ring_slots(S, stage.R)
        self.keep_residuals = program.keep_residuals
        self.x0, _ = jax.eval_shape(lambda r: stage.prefix(r, 0), stage.rest)
        self.shapes, self.kept = self._ring_layout()
        self.start = vary(jnp.zeros(self.x0.shape, self.x0.dtype), manual)  # what a stage holds before it receives
        self.down = [(i, (i + 1) % S) for i in range(S)]  # the forward's permute: to the next stage
        self.up = [((i + 1) % S, i) for i in range(S)]  # the backward's: to the one before
        self.last = stage.s == S - 1
        self.stats = self.dstats = None
        if stage.aux:
            # A mixture of experts: its load-balancing loss is a product of whole-batch means,
            # so every microbatch's backward needs every microbatch's routing. A forward pass of
            # all work items first (no head, nothing kept but the statistics) gives them; the
            # loss's gradient with respect to them is the same for every microbatch, and the
            # backward of item (m, shard) takes 1/(M*shards) of it: the statistics are means.
            self.stats = self._router_stats()
            self.dstats = self._stats_cotangent()
            self.start = _tie(self.start, self.dstats)  # the schedule's collectives after the first pass's

    def run(self):
        """``(loss, extras, g_stack, g_rest)`` of the step, the same on every device: the
        ``(M + 2S - 2)`` ticks (interleaved: ``R*M + S*R + S - 2``) in three scans, each
        compiled once, then the sums."""
        S, M, R, V = self.stage.S, self.stage.M, self.stage.R, self.stage.V
        phases = (
            (0, V - 1, True, False),  # fill: forwards only
            (V - 1, R * M + S - 1, True, True),  # steady: one forward and one backward per tick
            (R * M + S - 1, R * M + V + S - 2, False, True),  # drain: backwards only
        )
        carry = self._initial_carry()
        for start, stop, fwd, bwd in phases:
            if stop > start:
                body = lambda c, t, fwd=fwd, bwd=bwd: self._tick(c, t, fwd, bwd)  # noqa: E731
                carry, _ = jax.lax.scan(body, carry, jnp.arange(start, stop))
        return self._totals(carry)

    # -- which work item a tick runs -----------------------------------------------------

    def forward_item(self, t):
        """``(item, repeat, microbatch, real)`` of this stage's forward at tick ``t``: item
        ``k = t - s``, in blocks of ``S*R``: microbatches ``qS .. qS+S-1`` through repeat 0,
        then the same ones through repeat 1, ... (so what stage S-1 finishes reaches
        stage 0 on the next tick, just in time for its next repeat)."""
        S, M, R, V = self.stage.S, self.stage.M, self.stage.R, self.stage.V
        k = t - self.stage.s
        q, w = k // V, k % V
        return k, w // S, q * S + w % S, (k >= 0) & (k < R * M)

    def backward_item(self, t, stage=None):
        """``(forward item, repeat, microbatch, real)`` of stage ``stage``'s backward at tick
        ``t`` (default: this one's): the same blocks, repeats in reverse, ``V - 1 + S - 1 - s``
        ticks behind."""
        S, M, R, V = self.stage.S, self.stage.M, self.stage.R, self.stage.V
        j = t - (V - 1) - (S - 1 - (self.stage.s if stage is None else stage))
        q, w = j // V, j % V
        r = R - 1 - w // S
        return q * V + r * S + w % S, r, q * S + w % S, (j >= 0) & (j < R * M)

    # -- the state the ticks carry -------------------------------------------------------

    def _ring_layout(self):
        """``(shapes, kept)``: what a slot of the ring holds, and under a remat policy which of
        the stage pullback's leaves those are. Without remat the stage input, from which the
        backward tick recomputes the stage. With one, the policy's residuals (per layer: its
        input under "full") wait in the ring and the backward tick runs the stored pullback:
        no second forward pass."""
        stage, x0 = self.stage, self.x0
        if not self.keep_residuals:
            return [x0], None
        found_kept = {}

        def residual_shapes(h, args, keys):
            _, leaves, _, kept = stage.group_vjp(h, args, keys, jnp.int32(0))
            found_kept["kept"] = kept
            return [leaves[i] for i in kept]

        shapes = jax.eval_shape(lambda r: residual_shapes(vary(jnp.zeros(x0.shape, x0.dtype), stage.manual),
                                                          *stage.prefix(r, 0)[1]), stage.rest)  # fmt: skip
        return shapes, found_kept["kept"]

    def _initial_carry(self) -> dict:
        stage, x0, manual = self.stage, self.x0, self.stage.manual
        ring = [vary(jnp.zeros((self.K,) + a.shape, a.dtype), manual) for a in self.shapes]
        zeros = lambda t: vary(jax.tree.map(jnp.zeros_like, t), manual)  # noqa: E731
        extras_shape = jax.eval_shape(lambda r: stage.tail(r, jnp.zeros(x0.shape, x0.dtype), 0, self.stats)[1], stage.rest)
        return {
            "act": self.start,  # received from upstream: the stage input of this tick's forward
            "cot": self.start,  # received from downstream: the cotangent of this tick's backward
            "ring": ring,
            "g_stack": zeros(jax.tree.leaves(stage.grouped)),  # (L/(S*R), R, ...) per leaf for R > 1
            "g_rest": zeros(stage.rest),
            "loss": vary(jnp.float32(0), manual),
            "extras": vary(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), extras_shape), manual),
        }

    # -- one tick ------------------------------------------------------------------------

    def _tick(self, carry, t, forward: bool, backward: bool):
        """Tick ``t``: this stage's forward of one work item (``forward``), then its backward of
        another (``backward``). Where both run, the last stage's forward output goes through
        the tail, whose cotangent its backward takes."""
        dy = None
        if forward:
            carry, dy = self._forward(carry, t, with_tail=backward)
        if backward:
            carry = self._backward(carry, t, dy, after=carry["act"] if forward else None)
        return carry, None

    def _forward(self, carry, t, with_tail: bool):
        """The forward of this tick's item: the stage's input (stage 0's first repeat: the
        prefix's output; else what the upstream stage sent), kept in the ring, through the
        group; the output (past the tail, ``with_tail``) sent downstream. Returns the carry
        and the tail's cotangent of the output (``None`` without the tail)."""
        stage, carry = self.stage, dict(carry)
        f, r_f, m_f, real_f = self.forward_item(t)
        x, (args, keys) = stage.prefix(stage.rest, m_f)
        h = jnp.where((stage.s == 0) & (r_f == 0), x, carry["act"])
        if self.keep_residuals:
            out, leaves, _, kept = stage.group_vjp(h, args, keys, r_f)
            out = out[0] if stage.aux else out
            _check_kept(kept, self.kept)
            carry["ring"] = _put(carry["ring"], [leaves[i] for i in kept], f % self.K)
        else:
            carry["ring"] = _put(carry["ring"], [h], f % self.K)
            out = stage.run_group(stage.group(r_f), h, args, keys, r_f, stage.frozen_group(r_f))
            out = out[0] if stage.aux else out
        dy = None
        if with_tail:  # the last stage's output is a microbatch's last repeat here (R = 1: always)
            carry, dy, tail_done = self._tail(carry, t, out, r_f, m_f, real_f)
            out = _tie(out, tail_done)
        # Collectives in one order on every device (see _tie): the permute after the tail,
        # the backward after the permute.
        carry["act"] = jax.lax.ppermute(out, stage.axis, self.down)
        return carry, dy

    def _tail(self, carry, t, out, r_f, m_f, real_f):
        """The head and the loss on the last stage's output ``out`` where it ends a microbatch's
        last repeat (elsewhere weighted 0), that microbatch weighted as the whole batch's mean
        weighs it: its loss, extras and head's gradients added to the carry. Returns the carry,
        the output's cotangent and what the permute after it must wait for."""
        stage, carry = self.stage, dict(carry)
        S, M, R, V = stage.S, stage.M, stage.R, stage.V
        tail_on = self.last & (r_f == R - 1) & real_f

        def run_tail():
            loss, tail_vjp, extras = jax.vjp(lambda r, y: stage.tail(r, y, m_f, self.stats), stage.rest, out, has_aux=True)
            w = jnp.where(tail_on, stage.pick(stage.weights, m_f), 0.0)
            g_rest, dy = tail_vjp(w.astype(loss.dtype))
            return loss.astype(jnp.float32) * w, g_rest, dy, extras

        _, top_last, _, top_real = _top_item(t, S, V, R, M)
        loss, g_rest, dy, extras = _when(None if R == 1 else top_last & top_real, run_tail, stage.manual)
        carry["g_rest"] = jax.tree.map(jnp.add, carry["g_rest"], g_rest)
        carry["loss"] = carry["loss"] + loss
        carry["extras"] = jax.tree.map(
            lambda acc, e: acc + jnp.where(tail_on, e.astype(jnp.float32) / M, 0.0), carry["extras"], extras)
        return carry, dy, (dy, loss, jax.tree.leaves(g_rest)[:1])

    def _backward(self, carry, t, dy, after=None):
        """The backward of this tick's item: the cotangent (the tail's ``dy`` on the last stage's
        last repeat, else what the downstream stage sent) through the group's pullback, its
        weight gradients added to the carry, the input's cotangent sent upstream (stage 0's
        first repeat: through the prefix, into the embedding's gradient). ``after``: what
        this tick's forward permute sent, which the backward's collectives follow."""
        stage, carry = self.stage, dict(carry)
        b, r_b, m_b, real = self.backward_item(t)
        if after is not None:
            b = _tie(b, after)
        cot = carry["cot"] if dy is None else jnp.where(self.last & (r_b == stage.R - 1), dy, carry["cot"])
        cot = jnp.where(real, cot, jnp.zeros_like(cot))
        stored = _get(carry["ring"], b % self.K)
        x, prefix_vjp, (args, keys) = jax.vjp(lambda r: stage.prefix(r, m_b), stage.rest, has_aux=True)
        cot = _tie(cot, x)  # the stage's backward after the prefix's forward
        out_b, pullback = self._pullback(stored, x, args, keys, r_b)
        if stage.aux:  # this group's share of the statistics' cotangent
            cot = (cot, self._stats_share(r_b, real, out_b[1]))
        g_layers, dh = pullback(cot)
        g_stack = jax.tree.leaves(g_layers)
        carry["g_stack"] = [self._add_group(a, g, r_b) for a, g in zip(carry["g_stack"], g_stack)]
        g_rest = self._prefix_grads(t, r_b, real, dh, prefix_vjp)
        carry["g_rest"] = jax.tree.map(jnp.add, carry["g_rest"], g_rest)
        carry["cot"] = jax.lax.ppermute(_tie(dh, g_rest, g_stack), stage.axis, self.up)
        return carry

    def _pullback(self, stored, x, args, keys, r):
        """The group's output and pullback for the backward of a work item of repeat ``r``:
        the stored pullback's residuals put back in it, or (without remat) a ``jax.vjp``
        recomputed from the stored stage input."""
        stage = self.stage
        if self.keep_residuals:
            # The pullback's structure, traced again here; its forward pass is dead code
            # (every residual comes from the ring), which XLA removes.
            out, leaves, structure, kept = stage.group_vjp(vary(jnp.zeros_like(x), stage.manual), args, keys, r)
            _check_kept(kept, self.kept)
            for i, value in zip(kept, stored):
                leaves[i] = value
            return out, jax.tree.unflatten(structure, leaves)
        frozen = stage.frozen_group(r)
        return jax.vjp(lambda st, hh: stage.run_group(st, hh, args, keys, r, frozen), stage.group(r), stored[0])

    def _add_group(self, acc, g, r):
        """``acc`` (a stacked weight's gradient, ``(L/(S*R), R, ...)`` for R > 1) plus repeat
        ``r``'s group's gradient ``g``."""
        if self.stage.R == 1:
            return acc + g
        return jax.lax.dynamic_update_index_in_dim(acc, jax.lax.dynamic_index_in_dim(acc, r, 1, False) + g, r, 1)

    def _prefix_grads(self, t, r_b, real, dh, prefix_vjp):
        """The gradients of the parameters outside the stacked layers that the prefix (the
        embedding) gives: stage 0's input cotangent of a first repeat through the prefix's
        pullback; zeros elsewhere."""
        stage = self.stage
        _, r_low, _, real_low = self.backward_item(t, stage=0)
        into_prefix = (stage.s == 0) & (r_b == 0) & real
        if not stage.rest:
            return []  # LoRA adapts the stacked layers alone: then nothing outside them trains
        (g_rest,) = _when(None if stage.R == 1 else (r_low == 0) & real_low,
                          lambda: prefix_vjp(jnp.where(into_prefix, dh, jnp.zeros_like(dh))), stage.manual)  # fmt: skip
        return g_rest

    # -- a mixture's statistics ----------------------------------------------------------

    def _router_stats(self):
        """The router statistics of the whole batch, per layer in layer order: a forward pass
        of every work item (``R*M + S - 1`` ticks, each one group's layers and one permute),
        averaged over the microbatches and the batch shards."""
        stage, stats = self.stage, self.stage.found.stats
        S, M, R, axis, data, s = stage.S, stage.M, stage.R, stage.axis, stage.data, stage.s
        per_group = lambda a: vary(jnp.zeros((stage.n_item, R) + a.shape[1:], jnp.float32), stage.manual)  # noqa: E731
        acc = jax.tree.map(per_group, stats)

        def body(carry, t):
            act, acc = carry
            _, r, m, real = self.forward_item(t)
            x, (args, keys) = stage.prefix(stage.rest, m)
            h = jnp.where((s == 0) & (r == 0), x, act)
            out, item_stats = stage.run_group(stage.group(r), h, args, keys, r, stage.frozen_group(r))

            def add(a, v):
                v = jnp.where(real, v.astype(jnp.float32) / M, 0.0)
                return jax.lax.dynamic_update_index_in_dim(a, jax.lax.dynamic_index_in_dim(a, r, 1, False) + v, r, 1)

            return (jax.lax.ppermute(out, axis, self.down), jax.tree.map(add, acc, item_stats)), None

        (act, acc), _ = jax.lax.scan(body, (self.start, acc), jnp.arange(R * M + S - 1))

        def layer_order(a, like):  # (L/(S*R), R, ...) on stage s -> (L, ...): layer (r*S + s)*L/(S*R) + j
            full = jnp.zeros((R, S) + a.shape[:1] + a.shape[2:], a.dtype)
            full = jax.lax.dynamic_update_index_in_dim(full, a.swapaxes(0, 1), s, 1)
            return full.reshape(like.shape)

        acc = jax.lax.psum(_tie(jax.tree.map(layer_order, acc, stats), act), axis)
        acc = jax.lax.pmean(acc, data) if data else acc
        return jax.tree.map(lambda a, like: a.astype(like.dtype), acc, stats)

    def _stats_cotangent(self):
        """The loss's gradient with respect to the whole batch's statistics, ``1/(M*shards)`` of
        it: what the backward of each (microbatch, shard) adds for its share."""
        stage, x0 = self.stage, self.x0
        zero_y = vary(jnp.zeros(x0.shape, x0.dtype), stage.manual)
        loss0, stats_vjp = jax.vjp(lambda st: stage.tail(stage.rest, zero_y, 0, st)[0], vary(self.stats, stage.manual))
        (dstats,) = stats_vjp(jnp.ones_like(loss0))
        return jax.tree.map(lambda g: g / (stage.M * stage.shards), dstats)

    def _stats_share(self, r_b, real, out_stats):
        """The statistics' cotangent of the backward's group (repeat ``r_b``) on this stage,
        typed like the group's statistics ``out_stats``; zeros for a bubble's item."""
        stage, n_item = self.stage, self.stage.n_item
        rows = lambda g: jax.lax.dynamic_slice_in_dim(g, (r_b * stage.S + stage.s) * n_item, n_item)  # noqa: E731
        share = jax.tree.map(lambda g: jnp.where(real, rows(g), jnp.zeros_like(rows(g))), self.dstats)
        return jax.tree.map(functools.partial(_typed_like, axis=stage.axis), share, out_stats)

    # -- the sums at the end -------------------------------------------------------------

    def _totals(self, carry):
        """``(loss, extras, g_stack, g_rest)``: the carry's sums over the manual axes, one
        after another and after the last permutes (see :func:`_tie`)."""
        stage, manual = self.stage, self.stage.manual
        loss = jax.lax.psum(_tie(carry["loss"], carry["act"], carry["cot"]), manual)
        extras = jax.tree.map(lambda e: jax.lax.psum(e, manual) / stage.shards, _tie(carry["extras"], loss))
        g_stack = [a.reshape((stage.n_local,) + a.shape[2:]) if stage.R > 1 else a
                   for a in _tie(carry["g_stack"], extras, loss)]  # fmt: skip
        g_stack = self.program.sum_over_batch(g_stack)
        g_rest = jax.lax.psum(_tie(carry["g_rest"], g_stack), manual) if stage.rest else []
        return loss, extras, g_stack, g_rest


def _when(pred, fn, manual: tuple):
    """``fn()`` where ``pred`` (the same on every device: it depends on the tick alone)
    holds, else zeros shaped like it; ``pred`` None: always. For R > 1 only some ticks
    need the head or the embedding's gradient: a ``cond`` skips the others' work."""
    if pred is None:
        return fn()
    run = lambda: vary(fn(), manual)  # noqa: E731
    return jax.lax.cond(pred, run, lambda: vary(_zeros(jax.eval_shape(fn)), manual))


def _put(ring, values, slot):
    """``ring`` (one array per kind of value, slots first) with ``values`` in slot ``slot``."""
    return [jax.lax.dynamic_update_index_in_dim(r, v, slot, 0) for r, v in zip(ring, values)]


def _get(ring, slot):
    """The values in slot ``slot`` of ``ring``."""
    return [jax.lax.dynamic_index_in_dim(r, slot, keepdims=False) for r in ring]


def _top_item(t, S: int, V: int, R: int, M: int):
    """``(item, is its last repeat, microbatch, real)`` of stage ``S-1``'s forward at tick ``t``:
    the same on every device, so a ``cond`` on it runs one branch everywhere."""
    k = t - (S - 1)
    q, w = k // V, k % V
    return k, w // S == R - 1, q * S + w % S, (k >= 0) & (k < R * M)


def _typed_like(cot, out, *, axis: str):
    """``cot`` as the cotangent of the stage's output ``out``: zeros where ``out`` does not
    vary over the stage axis (a constant of the layer, such as a dropless router's dropped
    share: everything computed from the stage's weights or input varies over it), else
    summed over the manual axes over which ``out`` is the same on every device."""
    if axis not in varying_axes(out):
        return varying_like(jnp.zeros(out.shape, out.dtype), out)
    return sum_to_type(cot, out)


def _zeros(shapes):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def _check_kept(kept: tuple, expected: tuple) -> None:
    if kept != expected:  # the weights are told from the residuals by identity; a JAX change could break that
        raise RuntimeError(f"1f1b: the stage's pullback keeps residuals {kept} here and {expected} when sized")


def _tie(value, *deps):
    """``value``, made to depend on ``deps`` (one element of each leaf): computed after them.

    XLA:CPU runs a program's operations as their data allow, on every device alike only as
    far as dependencies go, and the schedule's permutes share one rendezvous key: two
    independent permutes (this tick's forward and backward ones) could meet the wrong
    partner, and independent collectives could wait on each other forever (optimization
    barriers do not help: they are gone from the compiled program). The dependency is a
    select on ``x != x`` (a NaN test), which no compiler pass may fold: ``value`` is
    unchanged unless a dependency holds a NaN, which then spreads to it."""
    firsts = [jnp.ravel(d)[0].astype(jnp.float32) for d in jax.tree.leaves(deps)]
    if not firsts:
        return value
    first = functools.reduce(jnp.add, firsts)
    nan = first != first

    def tie(v):
        if jnp.issubdtype(v.dtype, jnp.floating):
            return v + jnp.where(nan, first, 0.0).astype(v.dtype)
        return v + nan.astype(v.dtype)

    return jax.tree.map(tie, value)
