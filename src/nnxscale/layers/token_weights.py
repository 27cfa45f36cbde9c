"""Which tokens a loss trains: each token's weight in the mean loss.

A document mask leaves out the tokens whose input is the separator (their target is the
next document's first token), and instruction and chat data mark the targets the loss does
not train, a prompt's, as :data:`IGNORED`. The model's loss, gradient accumulation and the
1F1B pipeline (:mod:`nnxscale.layers.one_f_one_b`) weigh (micro-)batches by the sum of
:func:`trained_weights`; :mod:`nnxscale.models.common.documents` re-exports both names.
"""

from __future__ import annotations

import jax.numpy as jnp

#: A target the loss does not train (``nnxscale.data.chat.IGNORED``, Hugging Face's -100).
IGNORED = -100


def trained_weights(inputs, targets, separator=None, ignored_targets: bool = False):
    """Each token's weight in the mean loss, float32 like ``inputs`` (any shape), or ``None``
    when every token counts: 0 where the input is the ``separator`` (a document mask) or,
    with ``ignored_targets``, where the target is :data:`IGNORED`; 1 elsewhere. The loss,
    gradient accumulation and the 1F1B pipeline weigh (micro-)batches by their sum."""
    weights = None
    if separator is not None:
        weights = (inputs != separator).astype(jnp.float32)
    if ignored_targets:
        kept = (targets != IGNORED).astype(jnp.float32)
        weights = kept if weights is None else weights * kept
    return weights
