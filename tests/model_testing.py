"""Helpers the model tests share: randomized weights, parameters by path, parameter counts
of deep models, greedy decoding by hand, and the forward pass as training runs it, on one
device or on a mesh with the activation rules in force."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

import nnxscale
from nnxscale.sharding.rules import batch_spec


def counts_by_depth(build, config, depth: str) -> tuple[list[int], int]:
    """Parameters of ``build(config)`` with 1 and 2 of its layers (abstract builds: nothing
    allocated), and the count at ``config``'s own depth, which is linear in the layers.

    Tracing the init of all 48 of gpt2-xl's blocks takes seconds (each random draw costs
    more as the trace grows); two shallow builds pin the whole model's count.
    """
    built = []
    for n in (1, 2):
        abstract = nnx.eval_shape(lambda: build(dataclasses.replace(config, **{depth: n})))  # noqa: B023
        leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
        built.append(sum(math.prod(x.shape) for x in leaves))
    return built, built[0] + (getattr(config, depth) - 1) * (built[1] - built[0])


def randomize(model, seed=0, scale=0.05):
    """Perturb every parameter (biases and norm scales too), so a wrong mapping shows.

    The noise is drawn with numpy on the host: eager jax.random would compile one program
    per parameter shape, seconds per model on a loaded CPU.
    """
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.Param))
    leaves = [jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape), x.dtype) for x in leaves]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


def params_by_path(model) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


# The forward pass as training runs it: jax.jit over the split state, merge inside. The
# graphdef is static, so models of one config (and layout) share one compilation.
_forward = jax.jit(lambda graphdef, state, tokens: nnx.merge(graphdef, state)(tokens), static_argnums=0)
_forward_dropout = jax.jit(
    lambda graphdef, state, tokens, key: nnx.merge(graphdef, state)(tokens, rngs=nnx.Rngs(dropout=key)),
    static_argnums=0,
)


def jit_logits(model, tokens, key=None):
    graphdef, state = nnx.split(model)
    if key is None:
        return np.asarray(_forward(graphdef, state, tokens))
    return np.asarray(_forward_dropout(graphdef, state, tokens, key))


def greedy_by_hand(model, ids: list[int], n: int, window: int) -> list[int]:
    """``n`` greedy tokens after ``ids``, the slow obvious way: the sequence so far through
    the whole model in one window of ``window`` tokens (causal, so the padding after it does
    not matter; one shape, so one compiled forward), argmax at its last position."""
    return greedy_rows_by_hand(model, [ids], n, window)[0]


def greedy_rows_by_hand(model, prompts: list[list[int]], n: int, window: int, rows: int = 1) -> list[list[int]]:
    """:func:`greedy_by_hand` of several prompts at once: they share each forward pass, in a
    batch of at least ``rows`` rows (callers that pass the same ``rows`` share one compiled
    forward; a row never sees another)."""
    seqs = [list(p) for p in prompts]
    for _ in range(n):
        padded = np.zeros((max(len(seqs), rows), window), np.int32)
        for i, ids in enumerate(seqs):
            padded[i, : len(ids)] = ids
        logits = jit_logits(model, jnp.asarray(padded))
        for i, ids in enumerate(seqs):
            ids.append(int(np.argmax(logits[i, len(ids) - 1])))
    return [ids[-n:] for ids in seqs]


def rules_for(mesh):
    """Default rules without the FSDP minimum size: the tiny models' tensors are kilobytes."""
    return nnxscale.resolve(None, mesh, min_shard_bytes=0)


def sharded_logits(model, mesh, tokens):
    """The forward pass as the trainer runs it: jitted, traced with the rules in force."""
    tokens = jax.device_put(tokens, NamedSharding(mesh, batch_spec(None, mesh)))
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens):
        with nnxscale.use_rules(rules_for(mesh)):
            return nnx.merge(graphdef, state)(tokens)

    return np.asarray(forward(state, tokens))
