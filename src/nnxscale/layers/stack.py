"""Stacked layers: ``n`` blocks of one architecture held as one module and run with a scan.

A deep model written as a Python loop over blocks compiles one copy of the block per layer
(gpt2-large's step took 8x gpt2's to compile), and on XLA:CPU rematerialization inside such
a loop is rescheduled away and saves nothing. Stacked, every Variable of the blocks gets a
leading axis of size ``n`` (logical name ``layers``) and :func:`scan_layers` runs them
with ``jax.lax.scan``: the block is compiled once, whatever the depth, and
``jax.checkpoint`` around the scanned body does what it promises.

Model code stays written for one device and one block::

    self.h = nnxscale.stack_layers(lambda rngs: Block(cfg, rngs=rngs), cfg.n_layer, rngs=rngs)
    ...
    x = nnxscale.scan_layers(self.h, x, keys=dropout_keys, remat=cfg.remat)

The rules place the ``layers`` axis (replicated by default); everything else about a
block's layout is unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from nnxscale.errors import ConfigError
from nnxscale.layers.remat import KEPT_NAMES, remat_name
from nnxscale.sharding.rules import LOGICAL_KEY

#: Logical name of the stacked layers' leading axis.
LAYERS = "layers"
#: The leading axis of a stack that a pipeline does not split (``stack_layers(...,
#: pipelined=False)``): it runs whole on every stage, before or after the pipelined stack.
OUTER_LAYERS = "outer_layers"
#: Both: the leading axis of stacked layers.
STACKED_AXES = (LAYERS, OUTER_LAYERS)

#: Rematerialization policies for :func:`scan_layers`: what each layer keeps for the
#: backward pass. ``none`` recomputes no matrix product and no exchange: it keeps the outputs
#: of the weight matmuls (the experts' grouped ones included) and of the experts' all-to-alls,
#: and recomputes only elementwise work (norms, activations, casts) and the attention's core
#: (its scores and probabilities, which a fused attention kernel recomputes anyway) inside
#: the backward pass's fusions. Keeping those too (no ``jax.checkpoint`` at all) would keep
#: every float32 intermediate of the norms and the GELU, about 7x the bytes per layer, which
#: on the H100 compiler pushes XLA's own rematerialization into recomputing the matmuls
#: instead (docs/steptime.md). ``full`` keeps only each layer's input
#: (the scan carry) and recomputes the layer in the backward pass; ``dots`` keeps the
#: outputs of the weight matmuls and recomputes the rest (elementwise ops, attention
#: scores, whose dots have batch dimensions, and the experts' products and exchanges);
#: ``dots-except-mlp-in`` keeps the values the models tag with :func:`kept` (the attention's
#: projections, its output projection, the MLP's output) and recomputes the MLP's input
#: projections, the widest products, with the rest (MaxText's ``save_dot_except_mlpwi``). A
#: module without the tags keeps nothing under it but the layer's input, as with ``full``.
def _products_and_exchanges(prim, *args, **params) -> bool:
    """The ``none`` policy: keep every weight matmul's output, the experts' grouped matmuls'
    (``ragged_dot``) and their exchanges' (all-to-all): what costs FLOPs or bandwidth to redo."""
    if prim.name in ("ragged_dot_general", "all_to_all", "ragged_all_to_all"):
        return True
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)


REMAT_POLICIES: dict[str, Callable] = {
    "none": _products_and_exchanges,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots-except-mlp-in": jax.checkpoint_policies.save_only_these_names(*KEPT_NAMES),
}


def kept(x, what: str):
    """``x``, tagged for the ``dots-except-mlp-in`` remat policy as one of
    :data:`~nnxscale.layers.remat.KEPT_NAMES` (``jax.ad_checkpoint.checkpoint_name``): a
    layer of your own keeps what it tags so under that policy. No effect under the others."""
    if what not in KEPT_NAMES:
        raise ValueError(f"kept(..., {what!r}): the names the policy keeps are {', '.join(KEPT_NAMES)}")
    return checkpoint_name(x, what)


def remat_policy(value: Union[str, bool, None]) -> str:
    """Normalize a remat setting (:func:`~nnxscale.layers.remat.remat_name`) and check it."""
    value = remat_name(value)
    if isinstance(value, str) and value in REMAT_POLICIES:
        return value
    raise ConfigError(f"unknown remat policy {value!r}: choose one of {', '.join(REMAT_POLICIES)}")


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], n: int, *, rngs: nnx.Rngs,
                 pipelined: bool = True) -> nnx.Module:  # fmt: skip
    """``n`` layers ``make_layer(rngs)`` as one module whose Variables have a leading ``(n,)`` axis.

    The layers hold the same random numbers as a Python list of ``n`` layers created one
    after another from ``rngs`` would, and ``rngs`` is left where that list would leave it.
    They are created at once: ``make_layer`` is traced once and vectorized over the layers
    (``jax.vmap``), so an init program draws each parameter once for all layers instead of
    once per layer, and its compilation does not grow with depth (gpt2-medium's 24 layers on
    fsdp=8: 6.5 s against 18.6 s one by one, ``bench/init_compile.py``). Every Variable's
    logical axes gain a leading ``layers`` name (Flax ``out_sharding`` annotations a leading
    ``None``). Under :func:`nnxscale.sharded_init` the stack is created inside the compiled
    init, so no device holds more than its shards.

    ``pipelined=False``: the leading axis is named ``outer_layers`` instead, which no rule
    puts on the ``stage`` axis: a pipeline (:func:`nnxscale.use_pipeline`) runs this stack
    whole on every stage, as a plain scan, and splits only the ``layers`` stack. A model
    whose layers are several stacks (DeepSeek's dense first layers before its mixture
    layers) marks all but its main one so, and the stages need only divide that one.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"stack_layers: n must be a positive number of layers, got {n!r}")
    stacked = _create_stacked(make_layer, n, rngs)
    for _, v in nnx.iter_graph(stacked):
        if not isinstance(v, nnx.Variable):
            continue
        meta = v.get_metadata()
        if meta.get(LOGICAL_KEY) is not None:
            v.set_metadata(**{LOGICAL_KEY: (LAYERS if pipelined else OUTER_LAYERS,) + tuple(meta[LOGICAL_KEY])})
        if meta.get("out_sharding") is not None:
            v.set_metadata(out_sharding=(None,) + tuple(meta["out_sharding"]))
    return stacked


def _create_stacked(make_layer: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """The ``n`` layers, vectorized: layer ``i`` draws stream ``s``'s keys from counts
    ``c_s + i * k_s + j`` (``c_s`` the stream's count, ``k_s`` the draws one layer takes), which
    are the keys the ``i``-th of ``n`` layers created in a row would draw (an
    :class:`nnx.RngStream`'s key is ``fold_in(key, count)``, and threefry under ``vmap`` gives
    each key's own numbers).

    ``k_s`` is counted by creating one layer abstractly (``jax.eval_shape``) with host
    (numpy) counts, which its draws advance without being traced.
    """
    names = list(rngs)
    keys = {name: rngs[name].key.get_value() for name in names}
    start = {name: rngs[name].count.get_value() for name in names}

    def layer_from(counts):
        r = nnx.Rngs(**keys)
        for name in names:
            r[name].count.set_value(counts[name])
        return make_layer(r), r

    probe = {}

    def count_draws():
        layer, r = layer_from({name: np.zeros(np.shape(start[name]), np.uint32) for name in names})
        probe["draws"] = {name: np.asarray(r[name].count.get_value()) for name in names}
        return nnx.state(layer)

    jax.eval_shape(count_draws)
    draws = probe["draws"]
    graphdef = None

    def one(i):
        nonlocal graphdef
        layer, _ = layer_from({name: start[name] + i * jnp.asarray(draws[name], jnp.uint32) for name in names})
        graphdef, state = nnx.split(layer)
        return state

    states = jax.vmap(one)(jnp.arange(n, dtype=jnp.uint32))
    for name in names:
        rngs[name].count.set_value(start[name] + n * jnp.asarray(draws[name], jnp.uint32))
    return nnx.merge(graphdef, states)


def is_pipelined(layers: nnx.Module) -> bool:
    """Whether a pipeline splits stacked ``layers`` over its stages (not made with
    ``stack_layers(..., pipelined=False)``)."""
    for _, v in nnx.iter_graph(layers):
        if isinstance(v, nnx.Variable):
            return (v.get_metadata().get(LOGICAL_KEY) or (None,))[0] != OUTER_LAYERS
    return True


def num_layers(layers: nnx.Module) -> int:
    """The size of the leading axis of stacked ``layers``."""
    leaves = jax.tree.leaves(nnx.state(layers))
    if not leaves:
        raise ConfigError("scan_layers: the stacked module has no state")
    return int(leaves[0].shape[0])


#: What runs stacked layers in place of the scan, or ``None``: set by
#: :func:`nnxscale.layers.pipeline.use_pipeline` (this module imports nothing of the pipeline's).
_RUNNER: contextvars.ContextVar[Optional[Callable]] = contextvars.ContextVar("nnxscale_layer_runner", default=None)


@contextlib.contextmanager
def layers_run_by(runner: Optional[Callable]):
    """Within the block :func:`scan_layers` calls ``runner(layers, x, *args, keys=, remat=)``
    instead of scanning (``None``: scan)."""
    token = _RUNNER.set(runner)
    try:
        yield
    finally:
        _RUNNER.reset(token)


@dataclasses.dataclass(frozen=True)
class Rows:
    """A :func:`scan_layers` argument with one entry per batch row (``(B, ...)``): per-example
    positions or document ids. Every layer gets ``value`` itself; a pipeline splits it into
    microbatches with the batch, where a plain argument goes unchanged to every microbatch."""

    value: Any


def _unwrap(args: tuple) -> tuple:
    return tuple(a.value if isinstance(a, Rows) else a for a in args)


def scan_layers(layers: nnx.Module, x, *args, keys=None, remat: Union[str, bool, None] = "none", cache=None,
                aux: bool = False):  # fmt: skip
    """Run stacked ``layers`` in order: ``x = layer_i(x, *args)`` (``key=keys[i]`` when given).

    Args:
      layers: a module from :func:`stack_layers`.
      x: the input of the first layer, e.g. the residual stream ``(B, T, C)``; every
        layer returns the same shape and dtype.
      args: passed to every layer: unchanged (rotary tables), or, wrapped in :class:`Rows`,
        per batch row (``(B, ...)``: per-example positions and document ids).
      keys: ``None``, or per-layer PRNG keys ``(n, ...)`` passed as ``key=``.
      remat: a policy of :data:`REMAT_POLICIES` (or ``True`` for ``"full"``).
      cache: ``None``, or a decoding cache (:mod:`nnxscale.layers.kv_cache`): a pytree whose
        leaves have a leading ``(n,)`` axis. Then layer ``i`` is called with ``cache=`` its
        slice and returns ``(x, its new cache)``, and ``scan_layers`` returns ``(x, new cache)``.
      aux: every layer returns ``(x, aux)``, ``aux`` a pytree of its own (a mixture's router
        statistics); ``scan_layers`` returns ``(x, aux stacked over the layers)``.

    The scan's state is one layer's input, so ``remat="full"`` keeps ``n`` residual-stream
    tensors for the backward pass and recomputes everything else one layer at a time.

    Within :func:`nnxscale.layers.pipeline.use_pipeline` the layers run as a pipeline over the
    mesh's ``stage`` axis instead (:func:`nnxscale.layers.pipeline.pipeline_layers`), with the
    same arguments: model code does not change.
    """
    runner = _RUNNER.get()
    if cache is not None:
        if runner is not None:
            raise ConfigError("decoding with a cache runs the layers in one scan, not as a pipeline: sample on a mesh "
                              "without a stage axis")  # fmt: skip
        return _scan_cached(layers, x, _unwrap(args), keys, cache)
    if runner is not None:
        return runner(layers, x, *args, keys=keys, remat=remat, aux=aux) if aux else runner(layers, x, *args, keys=keys, remat=remat)
    graphdef, state = nnx.split(layers)
    return scan_state(graphdef, state, x, *_unwrap(args), keys=keys, remat=remat, aux=aux)


def _scan_cached(layers: nnx.Module, x, args: tuple, keys, cache):
    """:func:`scan_layers` with a decoding cache: each layer's slice of it goes in and comes out."""
    graphdef, state = nnx.split(layers)

    def body(h, xs):
        layer_state, key, layer_cache = xs
        layer = nnx.merge(graphdef, layer_state)
        kw = {"cache": layer_cache} if keys is None else {"cache": layer_cache, "key": key}
        return layer(h, *args, **kw)

    return jax.lax.scan(body, x, (state, keys, cache))


def scan_state(graphdef, state, x, *args, keys=None, remat: Union[str, bool, None] = "none", pick=None,
               aux: bool = False):  # fmt: skip
    """:func:`scan_layers` on a split stack: ``state`` holds the layers' stacked values.

    The one scan every stacked run goes through, whole (:func:`scan_layers`) or one
    pipeline stage's group of layers at a time (:mod:`nnxscale.layers.pipeline`). With ``pick``
    (an index), every leaf of ``state`` is ``(n, k, ...)``: ``k`` alternatives for each
    layer, of which layer ``i`` uses ``[i, pick]``. The choice is made inside the
    rematerialized body and is recomputed, not saved, for the backward pass, so the
    chosen layers are never copied per call: a pipeline stage picks its repeat this way.
    ``aux``: see :func:`scan_layers`.
    """
    policy = REMAT_POLICIES[remat_policy(remat)]

    def body(h, xs):
        layer_state, key = xs
        if pick is not None:
            layer_state = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, pick, keepdims=False), layer_state)
        layer = nnx.merge(graphdef, layer_state)
        out = layer(h, *args) if keys is None else layer(h, *args, key=key)
        return out if aux else (out, None)

    body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    out, stats = jax.lax.scan(body, x, (state, keys))
    return (out, stats) if aux else out
