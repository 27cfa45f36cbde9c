"""Direct preference optimization (DPO, Rafailov et al. 2023): ``--objective dpo``.

A batch holds preference pairs (:mod:`nnxscale.data.chat`): rows ``2k`` and ``2k + 1`` are
the prompt with its chosen and with its rejected answer, their prompt and padding targets
:data:`~nnxscale.models.common.documents.IGNORED`. For each row the log-probability of its
answer, ``log pi(y | x)``, is the sum over its trained tokens; the loss of a pair is

    -log sigmoid(beta * ((log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))))

averaged over the pairs, where ``ref`` is the frozen reference model. The implicit rewards
are ``beta * (log pi - log ref)``; the step reports their means for the chosen and the
rejected answers, the mean margin between them (``reward_margin``) and the share of pairs
whose chosen answer has the larger reward (``reward_accuracy``).

The reference's log-probabilities come from :func:`reference_log_probs`, the one place
that says what the reference is: the parameters the run started from, held frozen in the
train state (``state["reference"]``, saved with it so a resumed run has the same); under
LoRA (``--lora-rank``) the frozen base itself with every adapter off
(:func:`nnxscale.layers.lora.disabled`), so the reference costs no second copy of the
weights, and a resumed run loads it with its base.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nnxscale.layers import lora
from nnxscale.layers.loss import CHUNK_BYTES, fewest_chunks, token_shards
from nnxscale.models import hidden_and_weights
from nnxscale.training.adapters import BASE, merge_params

#: The train state's entry holding the reference parameters.
REFERENCE = "reference"


def sequence_log_probs(model, inputs, targets, *, rngs=None, separator: Optional[int] = None):
    """``(log_probs, extras)``: ``(B,)`` float32, each row's summed log-probability of its
    trained targets (those not ``IGNORED``, nor after a ``separator`` input), and a
    mixture's router terms (``None`` for a dense model).

    The head runs over chunks of tokens as the chunked loss runs it
    (one chunk's logits within :data:`nnxscale.layers.loss.CHUNK_BYTES` per
    device), each chunk recomputed in the backward pass, summing per row instead of over
    the batch.
    """
    hidden, targets, weights, extras = hidden_and_weights(model, inputs, targets, rngs, separator, True)
    B, T, _ = hidden.shape
    # chunks of tokens (a divisor of T) whose float32 logits fit the chunked loss's budget per device
    chunks = fewest_chunks(T, B * T * model.config.vocab_size * 4 / token_shards(), CHUNK_BYTES)

    def row_sums(x, t, w):  # (B, t, C), (B, t), (B, t) -> (B,)
        logits = model.logits(x).astype(jnp.float32)
        return -jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, t) * w, axis=1)

    if chunks == 1:
        return row_sums(hidden, targets, weights), extras

    @jax.checkpoint
    def body(total, xs):
        return total + row_sums(*xs), None

    xs = (strided(hidden, chunks), strided(targets, chunks), strided(weights, chunks))
    total, _ = jax.lax.scan(body, jnp.zeros((B,), jnp.float32), xs)
    return total, extras


def strided(a, chunks: int):
    """``(B, T, ...) -> (chunks, B, T / chunks, ...)``: chunk ``i`` holds tokens ``i, i + n, ...``."""
    B, T = a.shape[:2]
    return jnp.moveaxis(a.reshape(B, T // chunks, chunks, *a.shape[2:]), 2, 0)


def dpo_loss(model, inputs, targets, *, rngs=None, reference, beta: float, separator: Optional[int] = None):
    """``(loss, metrics)`` of a batch of preference pairs (rows ``2k``: chosen, ``2k + 1``:
    rejected) against the reference's ``(B,)`` log-probabilities ``reference`` (see the
    module docstring). A mixture of experts adds its router losses, as in pre-training."""
    log_probs, extras = sequence_log_probs(model, inputs, targets, rngs=rngs, separator=separator)
    ratio = log_probs - jax.lax.stop_gradient(reference)
    chosen, rejected = beta * ratio[0::2], beta * ratio[1::2]
    margin = chosen - rejected
    loss = jnp.mean(jax.nn.softplus(-margin))  # -log sigmoid(margin)
    metrics = {"reward_chosen": jnp.mean(chosen), "reward_rejected": jnp.mean(rejected),
               "reward_margin": jnp.mean(margin), "reward_accuracy": jnp.mean((margin > 0).astype(jnp.float32))}  # fmt: skip
    if extras is not None:
        loss = loss + extras.pop("router_aux_term") + extras.pop("router_z_term")
        metrics |= extras
    return loss, metrics


def on_reference(graphdef, state, fn):
    """``fn(model)`` for the frozen reference model (no gradient flows into it).

    The reference is ``state["reference"]``, the parameters the run started from; in a LoRA
    run (no such entry) it is ``state["base"]`` with the adapters off.
    """
    if REFERENCE in state:
        return fn(nnx.merge(graphdef, jax.lax.stop_gradient(state[REFERENCE])))
    with lora.disabled():  # the adapters stay in the graph (its structure) but add nothing
        return fn(nnx.merge(graphdef, jax.lax.stop_gradient(merge_params(state[BASE], state["params"]))))


def reference_log_probs(graphdef, state, inputs, targets, *, separator: Optional[int] = None):
    """The frozen reference's (:func:`on_reference`) ``(B,)`` log-probabilities of a batch."""
    return on_reference(graphdef, state, lambda model: sequence_log_probs(model, inputs, targets, separator=separator)[0])
