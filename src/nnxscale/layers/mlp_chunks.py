"""A transformer MLP over chunks of its intermediate dimension.

An MLP's intermediate activations are the widest of a layer: ``(tokens x intermediate)``,
512 MiB float32 for one 16,384-token sequence of llama-3.2-1b (8,192 wide), and its
backward holds several of them at once. :func:`chunked_mlp` computes the MLP one slice of
the intermediate dimension at a time inside a rematerialized ``lax.scan`` and sums the
slices' outputs: ``down(act(x @ W1) * (x @ W2)) = sum_j down_j(act(x @ W1_j) * (x @ W2_j))``.
Each weight slice, and its gradient, is touched once, so FSDP gathers and reduces exactly
what it does without chunks (chunks of tokens instead, tried first, gathered the weights or
reduced their gradients once per chunk: 26% more all-reduce on llama-3.2-1b at 16k tokens).

Chunks are counted so that one slice's intermediate stays under a budget per device
(:func:`chunk_budget`: :data:`CHUNK_BYTES` on XLA:CPU, an eighth of the chip's memory on an
accelerator); short sequences take one chunk, which is the plain computation, the same
program as without chunking. Where the activation rules split the intermediate over a mesh axis
(tensor parallelism) there are no chunks: each slice's output would be all-reduced over
that axis, once per chunk, and the split already divides the intermediate per device.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from nnxscale.layers.attention import device_of
from nnxscale.layers.loss import fewest_chunks, token_shards
from nnxscale.sharding.activations import current_rules
from nnxscale.sharding.devices import memory_of

#: One chunk's float32 intermediate activation, per device, stays under this on XLA:CPU
#: (and on an accelerator whose memory is not known).
CHUNK_BYTES = 128 << 20

#: On an accelerator, one chunk's float32 intermediate stays under this share of the chip's memory.
ACCELERATOR_SHARE = 1 / 8


def chunk_budget(mesh=None) -> int:
    """Bytes one chunk's float32 intermediate may take per device on ``mesh``'s devices
    (default: those of the activation rules in force).

    Chunks cost time on an accelerator: each slice's weights are gathered (FSDP) and its
    gradients reduced on their own, in a loop too short to hide them, and the slices' outputs
    are summed in float32. MaxText's 16B model on a v5e-256 (``fsdp=256``, 6 x 2,048 tokens per
    chip, intermediate 28,672): 14 chunks of 128 MiB predicted 12.11 s per step (2.60 s of
    memory-bound ops, 0.88 s of exposed collectives), one chunk 10.24 s (1.24 s and 0.38 s) at
    8.4 GiB per chip instead of 6.3 of 16 (``nnxscale plan --target v5e-256``; MaxText's
    published run: 10.06 s). So on an accelerator the budget is
    :data:`ACCELERATOR_SHARE` of its memory (one intermediate of 1/8; the backward holds a few
    in the compute dtype), never below :data:`CHUNK_BYTES`; on XLA:CPU, whose plans of long
    sequences it was sized for, :data:`CHUNK_BYTES`.
    """
    if mesh is None:
        rules = current_rules()
        mesh = None if rules is None else rules.mesh
    device = device_of(mesh)
    memory = None if device is None or device.platform == "cpu" else memory_of(device)
    return CHUNK_BYTES if memory is None else max(CHUNK_BYTES, int(memory * ACCELERATOR_SHARE))


def chunk_count(tokens: int, width: int, shards: int = 1, budget: Optional[int] = None) -> int:
    """The fewest chunks (a divisor of ``width``) for which ``tokens x width / chunks`` float32
    values, split ``shards`` ways, fit ``budget`` bytes (default :data:`CHUNK_BYTES`)."""
    budget = CHUNK_BYTES if budget is None else budget
    return fewest_chunks(width, tokens * width * 4 / max(shards, 1), budget)


def _tensor_parallel(width: int) -> bool:
    rules = current_rules()
    return rules is not None and rules.activation_split("mlp", width) > 1


def chunked_mlp(fn: Callable, x, weights: Sequence[tuple], width: int, *, budget: Optional[int] = None):
    """``fn(x, *weights)`` computed as the sum of ``fn(x, *slices)`` over slices of the
    intermediate dimension (of size ``width``), rematerialized one at a time.

    ``weights``: ``(array, axis)`` pairs, ``axis`` the array's intermediate dimension; slice
    ``j`` of ``n`` takes indices ``j, j + n, ...`` of it. ``fn`` must be a sum over that
    dimension (an MLP: its activation acts on each intermediate unit alone). The result has
    ``fn``'s dtype; the slices are summed in float32. ``budget``: default :func:`chunk_budget`.
    """
    tokens = math.prod(x.shape[:-1])
    if _tensor_parallel(width):
        chunks = 1
    else:
        chunks = chunk_count(tokens, width, token_shards(), chunk_budget() if budget is None else budget)
    if chunks == 1:
        return fn(x, *(w for w, _ in weights))

    def sliced(w, axis):  # (..., width, ...) -> (chunks, ..., width / chunks, ...)
        shape = w.shape[:axis] + (width // chunks, chunks) + w.shape[axis + 1 :]
        return jnp.moveaxis(w.reshape(shape), axis + 1, 0)

    slices = tuple(sliced(w, axis) for w, axis in weights)
    out = jax.eval_shape(fn, x, *(jax.ShapeDtypeStruct(s.shape[1:], s.dtype) for s in slices))

    @jax.checkpoint
    def body(total, ws):
        return total + fn(x, *ws).astype(jnp.float32), None

    total, _ = jax.lax.scan(body, jnp.zeros(out.shape, jnp.float32), slices)
    return total.astype(out.dtype)
