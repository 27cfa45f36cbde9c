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

**Memory.** A stage keeps a ring of ``2S-1`` slots (stage inputs, or the remat policy's
residuals; SPMD gives every stage the ring stage 0 needs), one microbatch's backward pass
at a time, and its gradients: nothing grows with ``M`` but the step's token arrays.

**Exactness.** The loss is the weighted sum over (microbatch, batch shard) of each one's
mean loss, each weighted by its share of the tokens the loss counts (all of them, or with
``separator`` those whose input is not the separator): the unpipelined loss, as gradient
accumulation splits it. Dropout keys: the model draws from ``fold_in(key, m*J + j)`` for
microbatch ``m`` in batch shard ``j`` of ``J``, so masks differ from an unpipelined step's
(their distribution does not).

Not (yet) supported, each refused with a :class:`~nnxscale.errors.ConfigError`: layers that
return router statistics (a mixture of experts, whose load-balancing loss is a product of
whole-batch means), the interleaved schedule (``repeats > 1``), and more than one stack of
layers run by :func:`~nnxscale.scan_layers` in the loss.
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
from nnxscale.layers.pipeline import _ACTIVE, _manual_axes, _mesh_for
from nnxscale.layers.stack import Rows, layers_run_by, remat_policy, scan_state
from nnxscale.models.common.documents import trained_weights
from nnxscale.sharding.activations import current_rules
from nnxscale.sharding.axes import EXPERT
from nnxscale.sharding.mesh import context_mesh, vary

__all__ = ["check_supported", "pipeline_value_and_grad", "ring_slots"]


def ring_slots(stages: int) -> int:
    """Stage inputs a stage keeps in 1F1B: ``2S - 1`` (stage ``s`` needs ``2(S-1-s)+1``; SPMD
    gives every stage stage 0's)."""
    return 2 * stages - 1


_MIXTURE = (
    "--pipeline-schedule 1f1b does not run a mixture of experts yet: its router's load-balancing loss is a product of "
    "whole-batch means, which no microbatch's backward pass knows; use --pipeline-schedule gpipe"
)


def check_supported(pipeline, rules, *, routed: bool = False) -> None:
    """Raise :class:`~nnxscale.errors.ConfigError` where 1F1B does not run yet: a mixture of
    experts (``routed``). ``pipeline`` and ``rules``: the run's, for what may follow."""
    if routed:
        raise ConfigError(_MIXTURE)


@dataclasses.dataclass
class _Found:
    """What the model's loss hands :func:`~nnxscale.scan_layers`, found by tracing it once."""

    path: Optional[tuple] = None  # where the stacked layers sit in the model
    graphdef: Any = None  # their graphdef
    remat: Any = "none"  # the policy the model asks for
    calls: int = 0


def _key_path(kp) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in kp)


def _call(objective, graphdef, params, inputs, targets, key, runner):
    """``(loss, extras)`` of ``objective`` with :func:`scan_layers` run by ``runner``."""
    model = nnx.merge(graphdef, params)

    def run(layers, x, *args, keys=None, remat="none", aux=False):  # what scan_layers calls
        return runner(model, layers, x, *args, keys=keys, remat=remat, aux=aux)

    with layers_run_by(run):
        out = objective(model, inputs, targets, rngs=None if key is None else nnx.Rngs(dropout=key))
    return out if isinstance(out, tuple) else (out, {})


def _discover(objective, graphdef, params, inputs, targets, key) -> _Found:
    found = _Found()

    def record(model, layers, x, *args, keys=None, remat="none", aux=False):
        found.calls += 1
        if aux:
            raise ConfigError(_MIXTURE)
        if found.calls > 1:
            raise ConfigError(
                "--pipeline-schedule 1f1b runs one stack of layers per loss, and this model's loss runs "
                "nnxscale.scan_layers more than once; use --pipeline-schedule gpipe"
            )
        found.path = next((tuple(p) for p, node in nnx.iter_graph(model) if node is layers), None)
        found.graphdef, found.remat = nnx.split(layers)[0], remat
        return jnp.zeros_like(x)

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
      pipeline: a :class:`~nnxscale.layers.pipeline.Pipeline` with ``repeats=1``.
      mesh: the mesh (default: as :func:`~nnxscale.layers.pipeline.use_pipeline` finds it).
      separator: the loss counts only tokens whose input is not ``separator``
        (``--document-mask``); ``None``: every token.
      ignored_targets: nor those whose target is ``IGNORED`` (``--loss-on completion``).

    Must be traced under the run's rules (:func:`nnxscale.use_rules`).
    """
    if pipeline.repeats != 1:
        raise ConfigError(
            f"--pipeline-schedule 1f1b with --pipeline-repeats {pipeline.repeats} (interleaved 1F1B) is not implemented "
            "yet: use --pipeline-repeats 1, or --pipeline-schedule gpipe for the circular schedule"
        )
    mesh = _mesh_for(pipeline, mesh)
    rules = current_rules()
    check_supported(pipeline, rules)
    found = _discover(objective, graphdef, params, inputs, targets, key)

    # The parameters: the stacked layers (split over the stages) and the rest (replicated over them).
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    n_path = len(found.path)
    in_stack = [_key_path(kp)[:n_path] == found.path for kp, _ in flat]
    leaves = [leaf for _, leaf in flat]
    stack = [a for a, s in zip(leaves, in_stack) if s]
    rest = [a for a, s in zip(leaves, in_stack) if not s]
    n_layers = int(stack[0].shape[0])
    pipeline.check(n_layers, inputs.shape[0], rules.batch_shard_count if rules is not None else 1)
    data, stack_specs = _manual_axes(_sub_tree(params, found.path), rules, pipeline.axis)
    if EXPERT in data:
        raise ConfigError(_MIXTURE)
    stack_specs = [P(pipeline.axis)] * len(stack) if isinstance(stack_specs, P) else jax.tree.leaves(
        stack_specs, is_leaf=lambda x: isinstance(x, P))  # fmt: skip

    def rebuild(stack_leaves, rest_leaves):
        it_s, it_r = iter(stack_leaves), iter(rest_leaves)
        return jax.tree.unflatten(treedef, [next(it_s) if s else next(it_r) for s in in_stack])

    def layers_state(stack_leaves):
        """The stacked layers as the State scan_state takes (their paths inside the stack)."""
        return _sub_tree(rebuild(stack_leaves, [None] * len(rest)), found.path)

    program = _Program(objective, graphdef, found, pipeline, data, (separator, ignored_targets), rebuild, layers_state)
    rows = P(data) if data else P()
    run = jax.shard_map(
        program,
        mesh=context_mesh(mesh),
        in_specs=(stack_specs, [P()] * len(rest), rows, rows, P()),
        out_specs=(P(), P(), stack_specs, [P()] * len(rest)),
        axis_names=frozenset((pipeline.axis,) + data),
    )
    token = _ACTIVE.set(None)  # the loss's own stacks (none here) would run unpipelined
    try:
        loss, extras, g_stack, g_rest = run(stack, rest, inputs, targets, key)
    finally:
        _ACTIVE.reset(token)
    return (loss, extras), rebuild(g_stack, g_rest)


def _sub_tree(params, path: tuple):
    """The part of ``params`` at ``path`` (the stacked layers')."""
    node = params
    for k in path:
        node = node[k]
    return node


class _Program:
    """One device's part of the 1F1B step (inside ``shard_map``)."""

    def __init__(self, objective, graphdef, found, pipeline, data, masks, rebuild, layers_state):
        self.objective, self.graphdef, self.found, self.pipe = objective, graphdef, found, pipeline
        self.data, self.masks, self.rebuild, self.layers_state = data, masks, rebuild, layers_state
        # Without remat the backward tick recomputes the stage from its input (one
        # microbatch's activations at a time); with a remat policy the forward tick's
        # pullback keeps what the policy saves (under "full" each layer's input) in the ring.
        self.keep_residuals = remat_policy(found.remat) != "none"

    def __call__(self, stack, rest, inputs, targets, key):
        S, M, axis, data = self.pipe.stages, self.pipe.microbatches, self.pipe.axis, self.data
        found = self.found
        s = jax.lax.axis_index(axis)
        shard = jax.lax.axis_index(data) if data else 0
        shards = math.prod(jax.lax.axis_size(a) for a in data)
        manual = (axis,) + data
        # Sums over the manual axes happen once, at the end: the parameters vary over them here.
        stack = vary(stack, data)
        rest = vary(rest, manual)
        layers = self.layers_state(stack)
        n_local = int(jax.tree.leaves(layers)[0].shape[0])  # L/S layers on this stage
        split = lambda a: a.reshape((a.shape[0] // M, M) + a.shape[1:]).swapaxes(0, 1)  # noqa: E731  (M, b, T)
        inputs, targets = split(inputs), split(targets)

        # Each (microbatch, shard)'s weight in the mean: its share of the tokens the loss counts.
        token_weights = trained_weights(inputs, targets, *self.masks)
        if token_weights is None:
            counts = jnp.ones((M,), jnp.float32)
        else:
            counts = jnp.sum(token_weights, axis=(1, 2))
        total = jax.lax.psum(jnp.sum(counts), data) if data else jnp.sum(counts)
        weights = vary(counts / total, manual)  # (M,)

        def pick(a, m):
            return jax.lax.dynamic_index_in_dim(a, jnp.clip(m, 0, M - 1), keepdims=False)

        def micro_key(m):
            return None if key is None else jax.random.fold_in(key, jnp.clip(m, 0, M - 1) * shards + shard)

        def prefix(rest_leaves, m):
            """``(x, (args, keys))``: the stacked layers' input for microbatch ``m`` and their arguments."""
            got = {}

            def record(model, lay, x, *args, keys=None, remat="none", aux=False):
                got["args"] = tuple(a.value if isinstance(a, Rows) else a for a in args)
                got["keys"] = keys
                got["x"] = x
                return jnp.zeros_like(x)

            params = self.rebuild(stack, rest_leaves)
            _call(self.objective, self.graphdef, params, pick(inputs, m), pick(targets, m), micro_key(m), record)
            return got["x"], (got["args"], got["keys"])

        def tail(rest_leaves, y, m):
            def given(model, lay, x, *args, keys=None, remat="none", aux=False):
                if x.shape != y.shape:
                    raise ConfigError(f"1f1b: the stacked layers' input {x.shape} is not their output {y.shape}")
                return y

            params = self.rebuild(stack, rest_leaves)
            return _call(self.objective, self.graphdef, params, pick(inputs, m), pick(targets, m), micro_key(m), given)

        def stage_keys(keys):
            if keys is None:
                return None
            return jax.lax.dynamic_slice_in_dim(keys, s * n_local, n_local)

        def run_stage(layer_state, h, args, keys):
            return scan_state(found.graphdef, layer_state, h, *args, keys=stage_keys(keys), remat=found.remat)

        K = ring_slots(S)
        x0, _ = jax.eval_shape(lambda r: prefix(r, 0), rest)

        def stage_vjp(h, args, keys, layers=layers):
            """The stage's ``jax.vjp`` as its output, its pullback's leaves and structure, and
            which leaves are residuals: those that are not the stage's weights."""
            weight_ids = {id(a) for a in jax.tree.leaves(layers)}
            out, pullback = jax.vjp(lambda st, hh: run_stage(st, hh, args, keys), layers, h)
            leaves, structure = jax.tree.flatten(pullback)
            return out, leaves, structure, tuple(i for i, a in enumerate(leaves) if id(a) not in weight_ids)

        if self.keep_residuals:
            # The remat policy's residuals (per layer: its input under "full") wait in the ring,
            # and the backward tick runs the stored pullback: no second forward pass.
            found_kept = {}

            def residual_shapes(h, args, keys):
                _, leaves, _, kept = stage_vjp(h, args, keys)
                found_kept["kept"] = kept
                return [leaves[i] for i in kept]

            shapes = jax.eval_shape(lambda r: residual_shapes(vary(jnp.zeros(x0.shape, x0.dtype), manual), *prefix(r, 0)[1]),
                                    rest)  # fmt: skip
            kept_static = found_kept["kept"]
        else:
            shapes = [x0]  # the stage input, from which the backward tick recomputes the stage
        act = vary(jnp.zeros(x0.shape, x0.dtype), manual)
        ring = [vary(jnp.zeros((K,) + a.shape, a.dtype), manual) for a in shapes]
        zeros = lambda t: vary(jax.tree.map(jnp.zeros_like, t), manual)  # noqa: E731
        extras_shape = jax.eval_shape(lambda r: tail(r, jnp.zeros(x0.shape, x0.dtype), 0)[1], rest)
        carry = {
            "act": act,  # received from upstream: the stage input of this tick's forward
            "cot": act,  # received from downstream: the cotangent of this tick's backward
            "ring": ring,
            "g_stack": zeros(stack),
            "g_rest": zeros(rest),
            "loss": vary(jnp.float32(0), manual),
            "extras": vary(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), extras_shape), manual),
        }
        put = lambda ring, values, slot: [jax.lax.dynamic_update_index_in_dim(r, v, slot, 0) for r, v in zip(ring, values)]  # noqa: E731
        get = lambda ring, slot: [jax.lax.dynamic_index_in_dim(r, slot, keepdims=False) for r in ring]  # noqa: E731
        down = [(i, (i + 1) % S) for i in range(S)]
        up = [((i + 1) % S, i) for i in range(S)]
        last = s == S - 1

        def tick(carry, t, forward: bool, backward: bool):
            carry = dict(carry)
            dy = None
            if forward:
                f = t - s  # this stage's forward microbatch
                x, (args, keys) = prefix(rest, f)
                h = jnp.where(s == 0, x, carry["act"])
                if self.keep_residuals:
                    out, leaves, _, kept = stage_vjp(h, args, keys)
                    _check_kept(kept, kept_static)
                    carry["ring"] = put(carry["ring"], [leaves[i] for i in kept], f % K)
                else:
                    carry["ring"] = put(carry["ring"], [h], f % K)
                    out = run_stage(layers, h, args, keys)
                if backward:  # the last stage's output is microbatch t - (S-1), always real here
                    loss, tail_vjp, extras = jax.vjp(lambda r, y: tail(r, y, f), rest, out, has_aux=True)
                    w = jnp.where(last, pick(weights, f), 0.0)
                    g_rest, dy = tail_vjp(w.astype(loss.dtype))
                    tail_done = (dy, loss, jax.tree.leaves(g_rest)[:1])
                    carry["g_rest"] = jax.tree.map(jnp.add, carry["g_rest"], g_rest)
                    carry["loss"] = carry["loss"] + w * loss.astype(jnp.float32)
                    carry["extras"] = jax.tree.map(
                        lambda acc, e: acc + jnp.where(last, e.astype(jnp.float32) / M, 0.0), carry["extras"], extras)
                # Collectives in one order on every device (see _tie): the permute after the tail,
                # the backward after the permute.
                carry["act"] = jax.lax.ppermute(_tie(out, tail_done) if backward else out, axis, down)
            if backward:
                b = t - 2 * (S - 1) + s  # this stage's backward microbatch
                if forward:
                    b = _tie(b, carry["act"])
                real = (b >= 0) & (b < M)
                cot = carry["cot"] if dy is None else jnp.where(last, dy, carry["cot"])
                cot = jnp.where(real, cot, jnp.zeros_like(cot))
                stored = get(carry["ring"], b % K)
                x, prefix_vjp, (args, keys) = jax.vjp(lambda r: prefix(r, b), rest, has_aux=True)
                cot = _tie(cot, x)  # the stage's backward after the prefix's forward
                if self.keep_residuals:
                    # The pullback's structure, traced again here; its forward pass is dead code
                    # (every residual comes from the ring), which XLA removes.
                    _, leaves, structure, kept = stage_vjp(vary(jnp.zeros_like(x), manual), args, keys)
                    _check_kept(kept, kept_static)
                    for i, value in zip(kept, stored):
                        leaves[i] = value
                    pullback = jax.tree.unflatten(structure, leaves)
                else:
                    _, pullback = jax.vjp(lambda st, hh: run_stage(st, hh, args, keys), layers, stored[0])
                g_layers, dh = pullback(cot)
                g_stack = jax.tree.leaves(g_layers)
                carry["g_stack"] = jax.tree.map(jnp.add, carry["g_stack"], g_stack)
                (g_rest,) = prefix_vjp(jnp.where((s == 0) & real, dh, jnp.zeros_like(dh)))
                carry["g_rest"] = jax.tree.map(jnp.add, carry["g_rest"], g_rest)
                carry["cot"] = jax.lax.ppermute(_tie(dh, g_rest, g_stack), axis, up)
            return carry, None

        phases = (
            (0, S - 1, True, False),  # fill: forwards only
            (S - 1, M + S - 1, True, True),  # steady: one forward and one backward per tick
            (M + S - 1, M + 2 * S - 2, False, True),  # drain: backwards only
        )
        for start, stop, fwd, bwd in phases:
            if stop > start:
                body = lambda c, t, fwd=fwd, bwd=bwd: tick(c, t, fwd, bwd)  # noqa: E731
                carry, _ = jax.lax.scan(body, carry, jnp.arange(start, stop))
        # The sums over the manual axes, one after another and after the last permutes (see tick).
        loss = jax.lax.psum(_tie(carry["loss"], carry["act"], carry["cot"]), manual)
        extras = jax.tree.map(lambda e: jax.lax.psum(e, manual) / shards, _tie(carry["extras"], loss))
        g_stack = _tie(carry["g_stack"], extras, loss)
        g_stack = jax.lax.psum(g_stack, data) if data else g_stack
        g_rest = jax.lax.psum(_tie(carry["g_rest"], g_stack), manual)
        return loss, extras, g_stack, g_rest


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
