"""The jitted training and evaluation steps.

The step is a ``jax.jit`` over the train state with buffer donation, so the host does no NNX
graph walk per step. Dropout keys are ``fold_in(key, step)``: a resumed run draws exactly
the keys an uninterrupted one would. A step whose loss or gradient norm is not finite is
skipped inside the program (:func:`skip_nonfinite`).

``NNXSCALE_STEP_XLA_OPTIONS`` (a JSON object of XLA options, e.g.
``{"xla_backend_optimization_level": 1}``) compiles the training step alone with those
options: it is the one program a run executes every step, where ``XLA_FLAGS`` set every
program's (the test suite compiles everything at LLVM ``-O0`` and its runs of many steps
their step at ``-O1``).
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.data import text as text
from nnxscale.errors import ConfigError, DonatedStateError
from nnxscale.jobs.distributed import StopVote
from nnxscale.layers.attention import platform_of
from nnxscale.layers.one_f_one_b import pipeline_value_and_grad
from nnxscale.layers.pipeline import use_pipeline
from nnxscale.models.common.documents import trained_weights
from nnxscale.sharding.axes import entry_axes
from nnxscale.sharding.activations import use_rules
from nnxscale.training.adapters import BASE, merge_params
from nnxscale.training import grpo
from nnxscale.training.preference import REFERENCE, reference_log_probs

#: Train-state entries no step changes: a LoRA run's base, --objective dpo's reference.
FROZEN = (BASE, REFERENCE)
from nnxscale.training.state import Setup


def loss_fn(graphdef, params, inputs, targets, key, loss: Callable, base=None):
    """``(loss, extras)`` of one (micro-)batch; ``key`` seeds dropout (``None``: evaluation).

    ``loss`` returns a scalar, or ``(scalar, extras)``: a dict of arrays the step reports
    beside the loss (a mixture's router losses and expert load), averaged over micro-batches.
    ``base``: a LoRA run's frozen weights beside ``params``, its adapters (not differentiated).
    """
    model = nnx.merge(graphdef, params if base is None else merge_params(base, params))
    out = loss(model, inputs, targets, rngs=None if key is None else nnx.Rngs(dropout=key))
    return out if isinstance(out, tuple) else (out, {})


def make_train_step(setup: Setup, *, vote: bool = False):
    """The jitted step: ``(state, batch) -> (state, metrics)``; donates the old state. A
    batch's entries beside ``inputs`` and ``targets`` (a GRPO rollout's ``advantages`` and
    ``old`` log-probabilities, each ``(B, T)``) go to the objective as keyword arguments.

    ``vote``: the step takes a third argument, every process's stop request
    (:meth:`nnxscale.jobs.distributed.StopVote.ballot`), and ``metrics["stop"]`` is the largest:
    the vote's all-reduce is part of the step, so it can never run in a different order
    than the step's own collectives on some device (see docs/multiprocess.md).
    """
    graphdef, tx, schedule, objective = setup.graphdef, setup.tx, setup.schedule, setup.model.loss
    accum, separator, ignored = setup.cfg.optim.grad_accum, setup.model.separator, setup.model.ignored_targets
    replicas = replica_axes(setup) if accum > 1 else ()
    reference_of = reference_step_log_probs(setup)
    grad_fn = jax.value_and_grad(lambda p, x, y, k, base=None: loss_fn(graphdef, p, x, y, k, objective, base), has_aux=True)
    if setup.pipeline is not None and setup.pipeline.one_f_one_b:  # the schedule computes the gradients itself
        grad_fn = functools.partial(pipeline_value_and_grad, objective, graphdef, pipeline=setup.pipeline, mesh=setup.mesh,
                                    separator=separator, ignored_targets=ignored)  # fmt: skip

    def step(state, batch, votes=None):
        params, base = state["params"], state.get(BASE)  # base: a LoRA run's frozen weights (no gradient)
        key = jax.random.fold_in(jax.random.wrap_key_data(state["key"]), state["step"])
        x, y = batch["inputs"], batch["targets"]  # (B, T) int32
        frozen = {} if base is None else {"base": base}
        bound = {k: v for k, v in batch.items() if k not in ("inputs", "targets")}  # a GRPO rollout's advantages (and old)
        if setup.model.reference:
            bound["reference"] = reference_of(graphdef, state, x, y)
        if bound:  # --objective dpo or grpo (no micro-batches: they would split the pairs, or the groups)
            fn = functools.partial(objective, **bound)
            (loss, extras), grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, x, y, key, fn, base), has_aux=True)(params)
        elif accum == 1:
            (loss, extras), grads = grad_fn(params, x, y, key, **frozen)
        else:
            # Strided micro-batches keep every micro-batch spread over all batch shards.
            micro = lambda a: a.reshape(a.shape[0] // accum, accum, a.shape[1]).swapaxes(0, 1)  # noqa: E731
            weighted = separator is not None or ignored

            def weighed(params, frozen, xm, ym, k):  # (loss x w, grads x w, w, extras): w its trained tokens (1: unweighted)
                (loss_i, extras_i), grads_i = grad_fn(params, xm, ym, k, **frozen)
                if not weighted:
                    return loss_i, grads_i, jnp.float32(1), extras_i
                # Each micro-batch's loss is a mean over the tokens it trains (not those after
                # a separator, nor a prompt's): weigh it by their count.
                w = jnp.sum(trained_weights(xm, ym, separator, ignored))
                return loss_i * w, jax.tree.map(lambda g: g * w, grads_i), w, extras_i

            if replicas:
                weighed = replica_partial(weighed, setup, replicas, weighted)

            def body(carry, xs):
                loss_sum, grad_sum, weight_sum = carry
                i, xm, ym = xs
                loss_i, grads_i, w, extras_i = weighed(params, frozen, xm, ym, jax.random.fold_in(key, i))
                return (loss_sum + loss_i, jax.tree.map(jnp.add, grad_sum, grads_i), weight_sum + w), extras_i

            zeros = jax.tree.map(jnp.zeros_like, params)
            if replicas:  # one partial sum per replica, each on its own devices
                sizes = setup.rules.sizes
                zeros = jax.tree.map(lambda z, sh: _stacked(z, sh, replicas, sizes), params, setup.param_shardings)
            carry = (jnp.float32(0), zeros, jnp.float32(0))
            (loss, grads, total), extras = jax.lax.scan(body, carry, (jnp.arange(accum), micro(x), micro(y)))
            if replicas:  # the one reduction over the replicas, after every micro-batch
                grads = jax.tree.map(functools.partial(_replica_sum, dtype=jnp.dtype(setup.cfg.model.dtype)), grads)
            total = total if weighted else accum
            loss, grads = loss / total, jax.tree.map(lambda g: g / total, grads)
            extras = jax.tree.map(lambda a: jnp.mean(a, axis=0), extras)
        grads = jax.lax.with_sharding_constraint(grads, setup.param_shardings)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"]), **extras}
        if votes is not None:
            metrics["stop"] = StopVote.reduce(votes)

        def update(params, opt_state):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return skip_nonfinite(state, update, metrics)

    in_shardings = (setup.state_shardings, setup.batch_sharding)
    if vote:
        in_shardings += (StopVote.sharding(setup.mesh),)
    return DonatingStep(jax.jit(
        _under_rules(step, setup),
        in_shardings=in_shardings,
        out_shardings=(setup.state_shardings, None),
        donate_argnums=0,
        compiler_options=step_compiler_options(setup),
    ))  # fmt: skip


class DonatingStep:
    """A jitted step that donates its first argument, the state. Called with a state it already
    took (whose arrays the backend deleted), it raises
    :class:`~nnxscale.errors.DonatedStateError` saying so before anything runs: JAX would say
    "Array has been deleted", or, with jaxlib 0.10's sharded XLA:CPU step, crash the process.
    Everything else (``lower``, ``trace``) is the jitted function's."""

    def __init__(self, jitted):
        self.jitted = jitted

    def __call__(self, state, *args):
        gone = sum(1 for x in jax.tree.leaves(state) if isinstance(x, jax.Array) and x.is_deleted())
        if gone:
            raise DonatedStateError(
                f"this train state was already passed to the step, which donates it ({gone} of its arrays are "
                "deleted): pass the state the step returned, `state, metrics = step(state, batch)`, or a copy "
                "taken before the step (jax.tree.map(jnp.copy, state))"
            )
        return self.jitted(state, *args)

    def __getattr__(self, name):
        return getattr(self.jitted, name)


def replica_axes(setup: Setup) -> tuple[str, ...]:
    """The batch axes of ``s``'s mesh that no parameter is split over (``data``, not ``fsdp``),
    where gradient accumulation sums each replica's gradients unreduced and reduces them once
    per step (:func:`replica_partial`); ``()`` where it cannot.

    Without this, XLA keeps the sum laid out like the parameters (replicated over those axes)
    and all-reduces every micro-batch's gradient: ``K`` times the bytes of one reduction per
    step (llama-mini on data=8, ``--grad-accum 4``: 4.12x, XLA:CPU). A replica's gradient is that
    of the loss over its own tokens, so this holds only for a loss that is a sum over tokens:
    a family's own next-token loss (not a mixture's, whose router losses couple the tokens of
    a batch, nor your own ``loss=``), and not in a pipeline (which accumulates its microbatches
    itself). On an FSDP axis the gradient is reduce-scattered per micro-batch still: summing it
    unreduced would hold the whole, unsharded gradient on every device.
    """
    if not sums_unreduced(setup.model, setup.pipeline):
        return ()
    shardings = jax.tree.leaves([setup.state_shardings["params"], setup.state_shardings.get(BASE)])
    split = {a for sh in shardings for entry in sh.spec for a in entry_axes(entry)}
    return tuple(a for a in setup.rules.batch_axes if a not in split and setup.rules.sizes[a] > 1)


def sums_unreduced(model, pipeline=None) -> bool:
    """Whether gradient accumulation sums ``model``'s (a :class:`RunModel`) gradients unreduced
    over the replicas (see :func:`replica_axes`): a family's own next-token loss, not a
    mixture's, no pipeline."""
    objective = model.loss.func if isinstance(model.loss, functools.partial) else model.loss
    return pipeline is None and model.family is not None and not model.routed and objective is model.family.loss


def _stacked(zeros, sharding, replicas: tuple, sizes: dict):
    """``zeros`` with a leading axis, one entry per replica (``replicas`` of the mesh), laid out
    over them, each entry like ``sharding``."""
    n = math.prod(sizes[a] for a in replicas)
    spec = P(replicas, *sharding.spec)
    return jax.lax.with_sharding_constraint(jnp.zeros((n, *zeros.shape), zeros.dtype), NamedSharding(sharding.mesh, spec))


def _replica_sum(g, dtype):
    """The replicas' partial sums ``g`` ``(replicas, *shape)`` summed, moved in the compute
    ``dtype`` where it is narrower than ``g``'s, as the compiler reduces one micro-batch's
    gradient (each replica's sum is still accumulated in ``g``'s dtype). H100, gpt2, data=8,
    ``--grad-accum 4``, bfloat16: 248.9 MB in bfloat16 (497.8 MB in float32; one micro-batch 326.2 MB)."""
    if dtype.itemsize >= g.dtype.itemsize:
        return jnp.sum(g, axis=0)
    # lax.reduce, not jnp.sum: that sums a bfloat16 array in float32, and the compiler moves it so
    return jax.lax.reduce(g.astype(dtype), jnp.zeros((), dtype), jax.lax.add, (0,)).astype(g.dtype)


def replica_partial(weighed: Callable, setup: Setup, replicas: tuple, weighted: bool) -> Callable:
    """``weighed(params, frozen, xm, ym, key) -> (loss, grads, weight, extras)`` of a micro-batch,
    run by each replica (``replicas``: mesh axes) on its own rows: ``grads`` come back unreduced,
    stacked ``(replicas, *shape)``, one partial sum per replica; ``loss`` and ``weight`` summed
    over them (scalars: the only reduction per micro-batch); ``extras`` averaged. Unless
    ``weighted`` (weights: trained tokens), a replica's mean counts 1 / replicas of the batch's.

    ``check_vma=False``: with it, JAX sums the gradient of the replicated parameters over the
    replicas inside (the transpose of their implicit broadcast), once per micro-batch."""
    rows = P(replicas)

    def local(params, frozen, xm, ym, key):
        key = jax.random.fold_in(key, jax.lax.axis_index(replicas))  # each replica its own dropout
        loss, grads, w, extras = weighed(params, frozen, xm, ym, key)
        if not weighted:
            w = w / math.prod(setup.rules.sizes[a] for a in replicas)
            loss, grads = loss * w, jax.tree.map(lambda g: g * w.astype(g.dtype), grads)
        total = lambda v: jax.lax.psum(v, replicas)  # noqa: E731
        return total(loss), jax.tree.map(lambda g: g[None], grads), total(w), jax.tree.map(lambda a: jax.lax.pmean(a, replicas), extras)

    return jax.shard_map(local, mesh=setup.mesh, in_specs=(P(), P(), rows, rows, P()), out_specs=(P(), rows, P(), P()),
                         axis_names=set(replicas), check_vma=False)  # fmt: skip


#: XLA options for the training step's compile alone (see the module's docstring).
ENV_STEP_XLA_OPTIONS = "NNXSCALE_STEP_XLA_OPTIONS"


#: XLA:CPU has no bfloat16 matrix product: it computes one in float32, and its
#: ``while-loop-invariant-code-motion`` pass then moves the conversion of a stacked weight out
#: of the layer loop, so the step holds a float32 copy of every layer's shard at once (one
#: layer's is all a product needs). llama-3.1-8b with a bfloat16 LoRA base on ``fsdp=8``,
#: 8 x 4,096, remat full: peak 9.8 GiB per device with the pass, 5.5 GiB without (every weight
#: training: 23.3 and 22.2 GiB; jax 0.10.2, ``nnxscale plan ... --compile always``).
#: The pass only moves work, so the numbers are the same; other compilers are left as they are.
CPU_BFLOAT16_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def step_compiler_options(setup: Optional[Setup] = None) -> Optional[dict]:
    """The XLA options the training step of ``s`` compiles with, or ``None``: on XLA:CPU with
    a bfloat16 compute dtype :data:`CPU_BFLOAT16_OPTIONS`, then ``NNXSCALE_STEP_XLA_OPTIONS``
    over them (unset or empty: nothing). Raises ConfigError in one line when that variable is
    not a JSON object."""
    options = {}
    if setup is not None and setup.cfg.model.dtype == "bfloat16" and platform_of(setup.mesh) == "cpu":
        options.update(CPU_BFLOAT16_OPTIONS)
    text = os.environ.get(ENV_STEP_XLA_OPTIONS, "").strip()
    if not text:
        return options or None
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        extra = e
    if not isinstance(extra, dict):
        raise ConfigError(
            f"{ENV_STEP_XLA_OPTIONS}={text!r} is not a JSON object of XLA options: "
            'give one like \'{"xla_backend_optimization_level": 1}\', or unset it'
        )
    return {**options, **extra}


def skip_nonfinite(state, update: Callable, metrics):
    """The divergence guard, inside the jitted step: ``(state, metrics)`` to return.

    ``update(params, opt_state) -> (params, opt_state)`` is the optimizer's step. When the
    loss or the gradient norm is not finite it does not run: the parameters and the
    optimizer state (its moments and its count) stay as they were, so a NaN or Inf never
    reaches them or a checkpoint. The step counter advances either way (the batch is used
    up), and ``metrics["skipped"]`` is 1 for a skipped step, else 0.

    A select per array between the updated and the old state, with no host round trip,
    rather than a ``lax.cond`` around the update: the accelerators' compilers fuse the select
    into the update (gpt2, data=8, 8 x 1,024, float32, ``--remat full``, temporaries per
    device beside the donated state's 1,493 MB: the H100 compiler needs 934 MB with the
    select and 1,991 MB with the cond; XLA:CPU 1,751 MB and 1,103 MB; TPU v5p, a 20.6M
    Llama, 430 MB either way).
    """
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    params, opt_state = update(state["params"], state["opt_state"])
    new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "key": state["key"]}
    trained = lambda tree: {k: v for k, v in tree.items() if k not in FROZEN}  # noqa: E731
    kept = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, trained(state))
    kept |= {k: state[k] for k in FROZEN if k in state}  # never updated
    kept["step"] = new_state["step"]
    return kept, {**metrics, "skipped": jnp.where(ok, 0, 1).astype(jnp.int32)}


def reference_step_log_probs(setup: Setup) -> Callable:
    """``(graphdef, state, inputs, targets) -> log-probabilities`` of the run's reference, as
    its objective takes them: per row for DPO, per token for GRPO's KL penalty."""
    if setup.cfg.objective == "grpo":
        return grpo.reference_token_log_probs
    return functools.partial(reference_log_probs, separator=setup.model.separator)


def make_policy_log_probs(setup: Setup):
    """The jitted ``(state, batch) -> (B, T)`` per-token log-probabilities of the policy (no
    gradient): a rollout's ``old`` ones, for ``--grpo-iterations`` above 1."""
    def run(state, batch):
        return grpo.policy_token_log_probs(setup.graphdef, state, batch["inputs"], batch["targets"])

    return jax.jit(_under_rules(run, setup), in_shardings=(setup.state_shardings, setup.batch_sharding),
                   out_shardings=setup.batch_sharding)  # fmt: skip


def make_eval_step(setup: Setup):
    """The jitted evaluation: ``(state, batch) -> loss`` (the train state: a LoRA run's frozen
    base and DPO's reference are in it)."""
    graphdef, objective = setup.graphdef, setup.model.loss
    reference_of = reference_step_log_probs(setup)

    def evaluate(state, batch):
        x, y = batch["inputs"], batch["targets"]
        fn = objective
        if setup.model.reference:
            fn = functools.partial(objective, reference=reference_of(graphdef, state, x, y))
        return loss_fn(graphdef, state["params"], x, y, None, fn, state.get(BASE))[0]

    return jax.jit(_under_rules(evaluate, setup), in_shardings=(setup.state_shardings, setup.batch_sharding))


def _under_rules(fn: Callable, setup: Setup) -> Callable:
    """``fn`` traced with the run's rules in force, so the model's ``constrain`` calls apply
    them, and its pipeline, so :func:`nnxscale.scan_layers` runs the stages."""

    @functools.wraps(fn)
    def traced(*args):
        with use_rules(setup.rules), use_pipeline(setup.pipeline, setup.mesh):
            return fn(*args)

    return traced
