"""The optimizer: AdamW with warmup and cosine decay, global-norm clipping, weight decay from Variable metadata.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nnxscale.data import text as text
from nnxscale.layers.stack import STACKED_AXES
from nnxscale.sharding.layout import format_bytes
from nnxscale.sharding.state import is_variable, variable_logical_axes
from nnxscale.training.config import TrainConfig

#: The logical name of a model's width, the residual stream.
WIDTH = "embed"


def decays(v: nnx.Variable) -> bool:
    """Whether AdamW's weight decay applies to this parameter: from its metadata, never its name.

    A ``weight_decay`` metadata flag decides when there is one
    (``nnxscale.logical(init, "embed", weight_decay=False)``). Otherwise the matrices decay:
    parameters whose logical axes hold the width (``embed``) and at least one more axis
    besides the stacked ``layers``: token and position embeddings, every projection. Norm
    scales (``embed`` alone) and biases (no ``embed``: ``(mlp,)``, ``(None, heads, kv)``)
    never do. A parameter without logical axes decays when it has two or more dimensions
    (nanoGPT's rule).
    """
    flag_value = v.get_metadata().get("weight_decay")
    if flag_value is not None:
        return bool(flag_value)
    names = variable_logical_axes(v)
    if names is None:
        return len(v.get_value().shape) >= 2
    axes = [n for n in names if n not in STACKED_AXES]
    return WIDTH in axes and len(axes) >= 2


def decay_mask(state) -> dict:
    """``{path: bool}`` as a plain dict like the params: :func:`decays` of each Variable."""
    return nnx.to_pure_dict(jax.tree.map(decays, state, is_leaf=is_variable))


def describe_decay(mask: dict, params: dict, weight_decay: float) -> str:
    """One line: how many parameter arrays decay, and how many of their bytes."""
    flags, arrays = jax.tree.leaves(mask), jax.tree.leaves(params)
    nbytes = [math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays]
    decayed = sum(b for b, f in zip(nbytes, flags) if f)
    return (
        f"weight decay {weight_decay:g} on {sum(flags)} of {len(flags)} parameter arrays, "
        f"{format_bytes(decayed)} of {format_bytes(sum(nbytes))} (matrices; not norms or biases)"
    )


def make_optimizer(cfg: TrainConfig, mask):
    """``(optax transform, lr schedule)``: AdamW, warmup + cosine, global-norm clipping.

    ``mask`` (:func:`decay_mask`, same structure as the params) says which parameters decay.
    """
    o = cfg.optim
    length = o.decay_steps or cfg.steps
    warmup = min(o.warmup_steps, max(length - 1, 0))
    if o.min_lr_ratio == 1.0 and warmup > 0:
        # No decay: the same values as the cosine from peak to peak, without the run's length
        # among the program's constants, so runs of any length share one compiled step.
        ramp = optax.linear_schedule(init_value=0.0, end_value=o.lr, transition_steps=warmup)
        schedule = optax.join_schedules([ramp, optax.constant_schedule(o.lr)], [warmup])
    else:
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=o.lr,
            warmup_steps=warmup,
            decay_steps=max(length, warmup + 1),
            end_value=o.lr * o.min_lr_ratio,
        )
    parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
    parts.append(optax.adamw(schedule, b1=o.beta1, b2=o.beta2, weight_decay=o.weight_decay, mask=mask))
    return optax.chain(*parts), schedule
