"""Mixtral's modules: the decoder's (:mod:`nnxscale.models.decoder`) with a
:class:`MixtralConfig`: Llama's attention, a mixture of experts in place of each MLP.
"""
from __future__ import annotations

from nnxscale.models.decoder.layers import DecoderLayer as MixtralDecoderLayer
from nnxscale.models.decoder.model import Decoder

__all__ = ["Mixtral", "MixtralDecoderLayer"]


class Mixtral(Decoder):
    """Mixtral language model: the decoder whose layers route each token to
    ``num_experts_per_tok`` of ``num_local_experts`` SwiGLU experts
    (``layers.block_sparse_moe``).

    ``hidden_states(..., with_stats=True)`` also returns every layer's router statistics,
    which the family's loss adds to the objective (load balance and z-loss).
    """
