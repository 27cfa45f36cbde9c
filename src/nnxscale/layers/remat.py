"""Rematerialization settings by name, without jax (the CLI and configs read them first).

``none`` keeps every intermediate for the backward pass; ``full`` keeps only each layer's
input and recomputes the layer; ``dots`` keeps the outputs of the weight matmuls. The jax
policies behind the names are :data:`nnxscale.layers.stack.REMAT_POLICIES`.
"""

from __future__ import annotations

from typing import Union

REMAT_NAMES = ("none", "full", "dots")


def remat_name(value: Union[str, bool, None]) -> Union[str, object]:
    """A remat setting as a policy name: ``True`` -> ``"full"``, ``False``/``None`` -> ``"none"``;
    any other value is returned as it is, for the caller to check against :data:`REMAT_NAMES`."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "full"
    return value
