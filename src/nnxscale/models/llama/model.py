"""Llama's modules: the decoder's (:mod:`nnxscale.models.decoder`) with a :class:`LlamaConfig`.
"""
from __future__ import annotations

from nnxscale.models.decoder.layers import MLP as LlamaMLP
from nnxscale.models.decoder.layers import Attention as LlamaAttention
from nnxscale.models.decoder.layers import DecoderLayer as LlamaDecoderLayer
from nnxscale.models.decoder.model import Decoder
from nnxscale.models.decoder.rope import rope_frequencies

__all__ = ["Llama", "LlamaAttention", "LlamaDecoderLayer", "LlamaMLP", "rope_frequencies"]


class Llama(Decoder):
    """Llama language model: the decoder with Llama's switches (all off); the output head is
    the token embedding when ``config.tie_word_embeddings``, else its own ``lm_head``."""
