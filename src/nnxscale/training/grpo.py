"""Group relative policy optimization (GRPO, Shao et al. 2024): the objective of
``--objective grpo``, its advantages and its loss normalizations.

A step's batch holds ``P`` prompts with ``G`` completions each (rows ``G p`` to ``G p + G - 1``
are prompt ``p``'s group), each row the prompt and one sampled completion, the prompt's
targets :data:`~nnxscale.models.common.documents.IGNORED`. Each completion has a scalar reward
``r``; its advantage, shared by its tokens, is relative to its group:

    A = (r - mean(group's r)) / (std(group's r) + eps)

``std`` with ``G - 1`` in the denominator, as TRL's ``GRPOTrainer`` computes it (``torch.std``),
``eps = 1e-4``. A group whose rewards are all equal has advantages 0: it teaches nothing.

Per completion token ``t`` (``pi`` the policy being trained, ``old`` the policy that sampled
the completion, ``ref`` the frozen reference):

    ratio = pi(t) / old(t)
    l(t)  = -min(ratio A, clip(ratio, 1 - clip_eps, 1 + clip_eps) A) + kl_beta k3(t)
    k3(t) = ref(t) / pi(t) - log(ref(t) / pi(t)) - 1       (Schulman's unbiased, positive KL estimator)

and the loss is ``l`` summed over a batch's completion tokens, divided by ``loss_norm``'s count:

- ``"token"`` (DAPO, Yu et al. 2025; the default): the batch's completion tokens. Every token
  weighs the same, so a long completion is not worth less per token than a short one, which
  per-sequence normalization makes it (Liu et al. 2025, Dr. GRPO: it biases the policy
  toward longer wrong answers); and, unlike ``"constant"``, the loss's scale does not depend
  on ``--max-new-tokens``. TRL's ``GRPOTrainer`` defaults to it too (``loss_type="dapo"``).
- ``"sequence"`` (GRPO as published): each completion's mean over its tokens, averaged over
  the completions.
- ``"constant"`` (Dr. GRPO): ``rows x max_new_tokens``, the same for every batch.

With one iteration per rollout (``--grpo-iterations 1``) ``old`` is ``pi`` itself (no
gradient through it): the ratio is 1 and the gradient is ``-A grad log pi``. With ``K``
iterations the rollout's log-probabilities are kept from before the first and the ratio
moves away from 1, clipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxscale.layers.loss import CHUNK_BYTES, fewest_chunks, token_shards
from nnxscale.models import hidden_and_weights
from nnxscale.training.adapters import model_params
from nnxscale.training.config import GRPO_LOSS_NORMS, GrpoSettings
from nnxscale.training.preference import on_reference, strided

#: The loss normalizations of ``--loss-norm`` (see the module docstring); the first is the default.
LOSS_NORMS = GRPO_LOSS_NORMS

#: Added to a group's standard deviation: a group of equal rewards divides 0 by it.
STD_EPS = 1e-4


def group_advantages(rewards, group: int) -> np.ndarray:
    """``(N,)`` float32 advantages of ``N = P x group`` rewards, rows in groups of ``group``
    consecutive ones: ``(r - group mean) / (group std + eps)``, std with ``group - 1``."""
    r = np.asarray(rewards, np.float64)
    if group < 2 or r.ndim != 1 or r.size % group:
        raise ValueError(f"{r.size} rewards do not make groups of {group} (at least 2 each)")
    g = r.reshape(-1, group)
    mean, std = g.mean(axis=1, keepdims=True), g.std(axis=1, ddof=1, keepdims=True)
    return ((g - mean) / (std + STD_EPS)).reshape(-1).astype(np.float32)


def token_log_probs(model, inputs, targets, *, rngs=None):
    """``(log_probs, weights, extras)``: ``(B, T)`` float32 log-probability of each target
    under ``model``, ``(B, T)`` float32 1 where the target is trained (not ``IGNORED``), and a
    mixture's router terms (``None`` for a dense model). The head runs over chunks of tokens,
    as :func:`nnxscale.training.preference.sequence_log_probs` runs it."""
    hidden, targets, weights, extras = hidden_and_weights(model, inputs, targets, rngs, None, True)
    B, T, _ = hidden.shape
    chunks = fewest_chunks(T, B * T * model.config.vocab_size * 4 / token_shards(), CHUNK_BYTES)

    def per_token(x, t):  # (B, t, C), (B, t) -> (B, t)
        logits = model.logits(x).astype(jnp.float32)
        return -optax.softmax_cross_entropy_with_integer_labels(logits, t)

    if chunks == 1:
        return per_token(hidden, targets), weights.astype(jnp.float32), extras
    out = jax.lax.map(jax.checkpoint(lambda xs: per_token(*xs)), (strided(hidden, chunks), strided(targets, chunks)))
    log_probs = jnp.moveaxis(out, 0, 2).reshape(B, T)  # (chunks, B, T / chunks) -> (B, T): token i of chunk c is c + i chunks
    return log_probs, weights.astype(jnp.float32), extras


def normalizer(weights, loss_norm: str, max_new_tokens: int):
    """What a batch's summed token losses are divided by: see the module docstring."""
    if loss_norm == "token":
        return jnp.maximum(jnp.sum(weights), 1.0)
    if loss_norm == "constant":
        return jnp.float32(weights.shape[0] * max_new_tokens)
    if loss_norm == "sequence":
        return None
    raise ValueError(f"loss_norm must be one of {', '.join(LOSS_NORMS)}, got {loss_norm!r}")


def objective(log_probs, weights, advantages, *, old=None, reference=None, kl_beta: float = 0.0,
              clip_eps: float = 0.2, loss_norm: str = "token", max_new_tokens: int = 1):  # fmt: skip
    """``(loss, metrics)`` from ``(B, T)`` per-token log-probabilities of the policy, their
    weights (1 on completion tokens), ``(B, T)`` advantages (each row's, on its tokens), and
    ``old`` and ``reference`` per-token log-probabilities (``None``: ``old`` is the policy
    without gradient, and no KL term without a reference). See the module docstring."""
    old = jax.lax.stop_gradient(log_probs) if old is None else old
    ratio = jnp.exp(log_probs - old)
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = -jnp.minimum(ratio * advantages, clipped * advantages)
    metrics = {}
    if reference is not None:
        delta = reference - log_probs
        k3 = jnp.exp(delta) - delta - 1.0
        per_token = per_token + kl_beta * k3
        metrics["kl"] = jnp.sum(k3 * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    total = normalizer(weights, loss_norm, max_new_tokens)
    if total is None:  # per sequence: each row's mean over its tokens, then the mean over rows
        rows = jnp.sum(per_token * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)
        loss = jnp.mean(rows)
    else:
        loss = jnp.sum(per_token * weights) / total
    # tokens where the clip took the gradient away (the ratio left the range in the advantage's direction)
    was_clipped = ((ratio < 1.0 - clip_eps) & (advantages < 0)) | ((ratio > 1.0 + clip_eps) & (advantages > 0))
    metrics["clip_fraction"] = jnp.sum(was_clipped * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return loss, metrics


def grpo_loss(model, inputs, targets, *, rngs=None, advantages, old=None, reference=None, kl_beta: float = 0.0,
              clip_eps: float = 0.2, loss_norm: str = "token", max_new_tokens: int = 1):  # fmt: skip
    """The GRPO loss of a batch of sampled completions (the model's ``loss`` for
    ``--objective grpo``): :func:`objective` over :func:`token_log_probs`. A mixture of experts
    adds its router losses, as in pre-training."""
    log_probs, weights, extras = token_log_probs(model, inputs, targets, rngs=rngs)
    loss, metrics = objective(log_probs, weights, advantages, old=old, reference=reference, kl_beta=kl_beta,
                              clip_eps=clip_eps, loss_norm=loss_norm, max_new_tokens=max_new_tokens)  # fmt: skip
    if extras is not None:
        loss = loss + extras.pop("router_aux_term") + extras.pop("router_z_term")
        metrics |= extras
    return loss, metrics


def run_loss(settings: GrpoSettings):
    """:func:`grpo_loss` with a run's ``--kl-beta``, ``--clip-eps``, ``--loss-norm`` and
    ``--max-new-tokens``: the step gives it each batch's advantages (and old log-probabilities)."""
    return functools.partial(grpo_loss, kl_beta=settings.kl_beta, clip_eps=settings.clip_eps, loss_norm=settings.loss_norm,
                             max_new_tokens=settings.max_new_tokens)  # fmt: skip


def reference_token_log_probs(graphdef, state, inputs, targets):
    """The frozen reference's (:func:`nnxscale.training.preference.on_reference`) ``(B, T)``
    per-token log-probabilities (no gradient)."""
    return on_reference(graphdef, state, lambda model: token_log_probs(model, inputs, targets)[0])


def policy_token_log_probs(graphdef, state, inputs, targets):
    """The policy's own ``(B, T)`` per-token log-probabilities (no gradient): a rollout's
    ``old`` log-probabilities, taken before its first iteration."""
    model = nnx.merge(graphdef, jax.lax.stop_gradient(model_params(state)))
    return token_log_probs(model, inputs, targets)[0]
