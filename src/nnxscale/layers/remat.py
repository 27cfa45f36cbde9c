"""Rematerialization settings by name, without jax (the CLI and configs read them first).

``none`` recomputes no matrix product (it keeps every weight matmul's output and the
experts' exchanges, and recomputes the elementwise work and the attention's core in the
backward pass's fusions); ``full`` keeps only each layer's
input and recomputes the layer; ``dots`` keeps the outputs of the weight matmuls;
``dots-except-mlp-in`` keeps those but the MLP's input projections (the widest: the
attention's query, key, value and output projections and the MLP's output are kept; the
MLP's input projections, its activation, the norms and the attention scores are recomputed;
MaxText's ``save_dot_except_mlpwi``). The jax policies behind the names are
:data:`nnxscale.layers.stack.REMAT_POLICIES`.
"""

from __future__ import annotations

from typing import Union

REMAT_NAMES = ("none", "full", "dots", "dots-except-mlp-in")

#: The values ``dots-except-mlp-in`` keeps, as the models tag them (:func:`nnxscale.layers.stack.kept`).
KEPT_NAMES = ("attention_projection", "attention_output", "mlp_output")


def remat_name(value: Union[str, bool, None]) -> Union[str, object]:
    """A remat setting as a policy name: ``True`` -> ``"full"``, ``False``/``None`` -> ``"none"``;
    any other value is returned as it is, for the caller to check against :data:`REMAT_NAMES`."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    return value
