"""Packed documents: where each token's document starts, and what a stacked layer is given.

A training row is a window of a token stream in which documents are joined by a separator
token (``nnxscale.data.text``): ``A A A | B B | C ...``. The separator ends the document
before it (a model learns to end a document), so with a document mask:

- ``segments``: token ``t``'s document id, the number of separators before ``t``;
- ``positions``: ``t``'s place in its document, 0 at each document's first token (RoPE,
  GPT-2's position embedding and the causal mask read it);
- ``weights``: 0 where the input is a separator, whose target is the next document's
  first token: no token is trained to predict across a boundary.

Instruction and chat data (:mod:`nnxscale.data.chat`) also mark the targets the loss does
not train, a prompt's: they are :data:`IGNORED` (:func:`trained_weights`; both defined in
:mod:`nnxscale.layers.token_weights`, below the models, and importable from here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nnxscale.layers.stack import Rows
from nnxscale.layers.token_weights import IGNORED, trained_weights  # noqa: F401  (re-exported)


def document_layout(tokens, separator: int):
    """``(positions, segments, weights)`` of ``tokens`` ``(B, T)``, each ``(B, T)``: int32,
    int32, float32 (see the module docstring)."""
    ends = tokens == separator
    T = tokens.shape[1]
    segments = jnp.cumsum(ends, axis=1, dtype=jnp.int32) - ends.astype(jnp.int32)
    index = jnp.arange(T, dtype=jnp.int32)
    after_end = jnp.where(ends, index + 1, 0)  # a document starts after each separator
    starts = jax.lax.cummax(jnp.pad(after_end[:, :-1], ((0, 0), (1, 0))), axis=1)
    return index - starts, segments, (~ends).astype(jnp.float32)


def layer_args(positions, segments) -> tuple:
    """The ``positions, segments`` a stacked attention layer takes, as
    :func:`~nnxscale.scan_layers` arguments: none when both are ``None``; per-row ones
    (``(B, T)``) wrapped in :class:`~nnxscale.layers.stack.Rows`, so a pipeline splits them
    with the batch."""
    if positions is None and segments is None:
        return ()
    wrap = lambda a: Rows(a) if a is not None and jnp.ndim(a) == 2 else a  # noqa: E731
    return (wrap(positions),) if segments is None else (wrap(positions), wrap(segments))
