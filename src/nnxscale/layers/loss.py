"""A next-token loss that never holds all the logits: the head and the cross-entropy run
over slices of the vocabulary.

The logits of a long sequence are the largest activation of a language model: ``(tokens x
vocabulary)`` float32, 8.4 GB for one 16,384-token sequence of Llama 3's 128,256-token
vocabulary, and as much again for their gradient. :func:`chunked_cross_entropy` computes
them one slice of the vocabulary at a time inside a ``lax.scan``, with its own backward:
the forward keeps each token's log-sum-exp (an online one over the slices), the backward
recomputes one slice's logits, takes their gradient and moves on. Each slice of the head
and of its gradient is touched once, so on FSDP the head is gathered, and its gradient
reduced, once per step (see the note above :func:`_vocab_ce`).

The number of slices is the fewest that keep one slice's float32 logits under
:data:`CHUNK_BYTES` per device; short sequences take one slice, which is the plain
computation: the logits held once in the compute dtype, and nothing recomputed. Between the
two, where all the slices' logits in the compute dtype fit :data:`KEEP_BYTES` per device, the
forward keeps them, and the head it gathered, for the backward: the step runs the head's
product three times (forward, the two gradients), not four, and gathers the head once.
llama-3.2-1b on TPU v5e-8 (fsdp=8, 2,048 tokens per chip): the matrix products 1.05x
MaxText's with the recompute, 1.00x without (docs/maxtext.md).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from nnxscale.layers.attention import zigzag
from nnxscale.sharding.activations import constrain, current_rules, manual_axes

#: One slice's logits, counted in float32 (the loss's dtype), per device, stay under this.
CHUNK_BYTES = 256 << 20

#: With several slices, the forward keeps every slice's logits in the compute dtype for the
#: backward when all of them take at most this per device; else the backward computes them again.
KEEP_BYTES = 512 << 20


def chunk_count(batch: int, length: int, vocab: int, shards: int = 1, budget: Optional[int] = None,
                itemsize: int = 4) -> int:  # fmt: skip
    """The fewest slices of the vocabulary whose logits (``itemsize`` bytes each) fit ``budget``
    bytes per device, when they are split ``shards`` ways: a divisor of ``vocab`` if one is at
    most twice that (else the last slice is padded)."""
    budget = CHUNK_BYTES if budget is None else budget
    need = max(1, math.ceil(batch * length * vocab * itemsize / max(shards, 1) / budget))
    divisor = fewest_chunks(vocab, need * budget, budget)
    return divisor if divisor <= 2 * need else need


def fewest_chunks(size: int, nbytes: float, budget: int) -> int:
    """The fewest chunks, a divisor of ``size``, that cut ``nbytes`` to at most ``budget`` each
    (``size`` chunks when none does)."""
    need = math.ceil(nbytes / budget)
    return next((d for d in range(max(need, 1), size + 1) if size % d == 0), size)


def token_shards() -> int:
    """How many ways the activation rules in force split the tokens (batch and length)."""
    rules = current_rules()
    if rules is None:
        return 1
    manual = manual_axes()  # inside a shard_map: already split
    return math.prod(rules.sizes[a] for a in rules.batch_axes + rules.length_axes if a not in manual)


def context_order(length: int):
    """The zigzag order of a sequence of ``length`` tokens when the rules in force split it
    over a ``context`` axis (:func:`nnxscale.layers.attention.zigzag`); None otherwise."""
    rules = current_rules()
    n = rules.length_shard_count if rules is not None else 1
    if n <= 1:
        return None

    order = zigzag(length, n)
    return None if (order == np.arange(length)).all() else order


def head_logits(x, head) -> jax.Array:
    """The output head: ``x`` (B, T, C) times ``head`` (C, V) in ``x``'s dtype (accumulated in
    float32) -> logits (B, T, V) in ``x``'s dtype, laid out like the whole's.

    Logits in the compute dtype, as MaxText's (unless ``logits_dot_in_fp32``): in bfloat16
    they take half the memory of float32 logits; the loss upcasts them and is float32.
    """
    logits = jnp.einsum("btc,cv->btv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)
    return constrain(logits.astype(x.dtype), "batch", "length", "vocab")


def chunked_cross_entropy(hidden, targets, head, *, weights=None, chunks: Optional[int] = None,
                          keep: Optional[bool] = None, softcap: Optional[float] = None) -> jax.Array:  # fmt: skip
    """Mean next-token cross-entropy of :func:`head_logits` ``(hidden, head)`` against
    ``targets``, in slices of the vocabulary, float32.

    ``hidden`` ``(B, T, C)``: the model's last hidden states; ``head`` ``(C, V)``: the output
    head's weight (its gradient comes back in its own dtype); ``targets`` ``(B, T)`` ints;
    ``weights`` ``(B, T)`` (optional): each token's weight, the mean is over their sum.
    ``chunks``: default :func:`chunk_count` (1: the logits are held whole, once, in the
    compute dtype, and the backward reuses them).

    The value and gradients are those of the plain loss over all the logits
    (``optax.softmax_cross_entropy_with_integer_labels`` of the upcast logits), computed
    with an explicit backward (:func:`_vocab_ce`): the forward keeps each token's
    log-sum-exp; the backward recomputes one slice of the logits at a time.

    ``softcap`` (Gemma 2's ``final_logit_softcapping``): the loss is over
    ``softcap * tanh(logits / softcap)``, applied to each slice in float32.
    """
    B, T, C = hidden.shape
    V = head.shape[-1]
    w = jnp.ones((B, T), jnp.float32) if weights is None else weights.astype(jnp.float32)
    if chunks is None:
        chunks = chunk_count(B, T, V, token_shards() * vocab_shards(V))
    chunks = max(1, min(chunks, V))
    # The head in the compute dtype: its gradient is reduced over the batch shards in it, as
    # every other weight's (bfloat16 halves those bytes), and upcast to the parameter after.
    if keep is None:
        keep = B * T * V * hidden.dtype.itemsize / (token_shards() * vocab_shards(V)) <= KEEP_BYTES
    keep = bool(keep) and chunks > 1
    total = _vocab_ce(hidden, head.astype(hidden.dtype), targets.astype(jnp.int32), w, chunks, keep,
                      None if softcap is None else float(softcap))  # fmt: skip
    return total / jnp.sum(w)


def vocab_shards(vocab: int) -> int:
    """How many ways the activation rules in force split a ``vocab``-wide activation."""
    rules = current_rules()
    return 1 if rules is None else rules.activation_split("vocab", vocab)


# Chunks of the vocabulary, not of the tokens: each slice of the head and of its gradient
# is touched once, so FSDP gathers the head and reduces its gradient once per step, as
# without chunks. Chunks of tokens would reduce the whole head gradient once per chunk (XLA
# keeps a scan's gradient carry laid out like the weight): 8.4 of the 10.4 GB of
# reduce-scatters of llama-3.2-1b's step on 8 H100s (fsdp=8, 8 x 4,096 tokens). Slice j holds words j, j + n, ..., so a vocabulary split over a mesh axis stays split.


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _vocab_ce(x, head, targets, w, chunks, keep=False, softcap=None):
    """``sum(w * cross-entropy)`` over the tokens; ``x`` (B, T, C), ``head`` (C, V),
    ``targets`` (B, T) int32, ``w`` (B, T) float32, the logits in ``chunks`` vocabulary slices."""
    return _ce_forward(x, head, targets, w, chunks, keep, softcap)[0]


def _slices(head, chunks: int):
    """``(C, V) -> (chunks, C, ceil(V / chunks))``: slice ``j`` holds words ``j, j + n, ...``;
    and the word id of each column of each slice ``(chunks, V / chunks)`` (``-1``: padding)."""
    C, V = head.shape
    width = -(-V // chunks)
    pad = width * chunks - V
    if pad:
        head = jnp.pad(head, ((0, 0), (0, pad)))
    ids = jnp.arange(width * chunks, dtype=jnp.int32).reshape(width, chunks).T  # (n, V / n)
    ids = jnp.where(ids < V, ids, -1)
    return jnp.moveaxis(head.reshape(C, width, chunks), 2, 0), ids


def capped(logits, softcap: Optional[float]):
    """``softcap * tanh(logits / softcap)`` (the logits unchanged without a cap)."""
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def _slice_logits(x, w_j, ids_j, logits=None, softcap=None):
    """One slice's logits, float32 ``(B, T, V / n)``, from the compute dtype's (padding: -inf);
    ``logits``: those in the compute dtype, kept from the forward (else computed)."""
    logits = capped((head_logits(x, w_j) if logits is None else logits).astype(jnp.float32), softcap)
    return jnp.where(ids_j >= 0, logits, -jnp.inf)


def _ce_forward(x, head, targets, w, chunks, keep=False, softcap=None):
    B, T, _ = x.shape
    if chunks == 1:
        logits = head_logits(x, head)  # (B, T, V) in the compute dtype: kept for the backward
        full = capped(logits.astype(jnp.float32), softcap)
        lse = jax.nn.logsumexp(full, axis=-1)
        picked = jnp.take_along_axis(full, targets[..., None], axis=-1)[..., 0]
        return jnp.sum((lse - picked) * w), (x, head, targets, w, lse, logits)
    if keep:  # the head gathered once, held for the backward like the logits (not gathered again there)
        head = constrain(head, None, "vocab")
    slices, ids = _slices(head, chunks)

    def body(carry, xs):  # an online log-sum-exp over the slices, and the target's logit
        m, s, picked = carry
        w_j, ids_j = xs
        kept = head_logits(x, w_j)  # (B, T, V / n) in the compute dtype
        logits = _slice_logits(x, w_j, ids_j, kept, softcap)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new[..., None]), axis=-1)
        picked = picked + jnp.sum(jnp.where(ids_j == targets[..., None], logits, 0.0), axis=-1)
        return (m_new, s, picked), kept if keep else None

    init = (jnp.full((B, T), -jnp.inf, jnp.float32), jnp.zeros((B, T), jnp.float32), jnp.zeros((B, T), jnp.float32))
    (m, s, picked), kept = jax.lax.scan(body, init, (slices, ids))  # kept (n, B, T, V / n) or None
    lse = m + jnp.log(s)
    return jnp.sum((lse - picked) * w), (x, head, targets, w, lse, kept)


def _ce_backward(chunks, keep, softcap, res, g):
    x, head, targets, w, lse, logits = res
    coef = g * w  # (B, T): d(sum) / d(each token's loss)

    def grads(logits, ids):  # d(loss)/d(logits) of a slice (B, T, v): (softmax - one-hot) x coef
        p = jnp.exp(logits - lse[..., None])
        d = (p - (ids == targets[..., None])) * coef[..., None]
        if softcap is not None:  # through the cap: d tanh(z / c) c / dz = 1 - tanh^2
            d = d * (1.0 - jnp.square(jnp.where(jnp.isfinite(logits), logits, 0.0) / softcap))
        return d.astype(x.dtype)

    def products(d, w_j):  # (dx, dW) of one slice: dx (B, T, C) float32, dW (C, v) in the head's dtype
        dx = jnp.einsum("btv,cv->btc", d, w_j.astype(x.dtype), preferred_element_type=jnp.float32)
        # dW comes out of the matmul in the head's (compute) dtype: a float32 product cast
        # afterwards is reduced across the FSDP shards in float32 first (twice the bytes; seen
        # on the H100 compiler for llama-3.2-1b's tied head), the other weights' gradients in bf16.
        dw = jnp.einsum("btc,btv->cv", x, d, preferred_element_type=head.dtype)
        return dx, dw

    if chunks == 1:
        d = grads(capped(logits.astype(jnp.float32), softcap), jnp.arange(head.shape[-1], dtype=jnp.int32))
        dx, dw = products(d, head)
        return dx.astype(x.dtype), dw, None, None
    slices, ids = _slices(head, chunks)

    def body(dx, xs):
        w_j, ids_j, kept_j = xs
        d = grads(_slice_logits(x, w_j, ids_j, kept_j, softcap), ids_j)
        dx_j, dw_j = products(d, w_j)
        return dx + dx_j, dw_j

    dx, dw = jax.lax.scan(body, jnp.zeros(x.shape, jnp.float32), (slices, ids, logits))  # dw (n, C, V / n)
    C, V = head.shape
    dw = jnp.moveaxis(dw, 0, 2).reshape(C, -1)[:, :V]
    return dx.astype(x.dtype), dw, None, None


_vocab_ce.defvjp(_ce_forward, _ce_backward)
