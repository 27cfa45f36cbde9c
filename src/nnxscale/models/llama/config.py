"""The llama config and its presets.
"""
from __future__ import annotations

import dataclasses

from nnxscale.models.common.model_config import choose_preset
from nnxscale.models.decoder.config import DecoderConfig
from nnxscale.models.decoder.rope import RopeScaling, parse_rope_scaling

__all__ = ["LlamaConfig", "PRESETS", "RopeScaling", "parse_rope_scaling", "preset"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Llama hyperparameters, named as in Hugging Face's ``LlamaConfig``: the decoder's
    (:class:`~nnxscale.models.decoder.DecoderConfig`) with its defaults.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` (:attr:`head_size`
    is the value in use). ``rope_scaling`` is a :class:`RopeScaling` (a dict of its fields
    is converted) or ``None`` for plain rotary embeddings. ``dtype`` is the compute dtype
    (parameters are cast at use; logits are always float32), ``param_dtype`` the storage
    dtype. ``dropout`` applies to embeddings and residual branches, and only when
    ``Llama.__call__`` gets ``rngs``. ``remat`` is a policy of
    :data:`nnxscale.layers.stack.REMAT_POLICIES` (``True`` means ``"full"``); ``attention``
    an implementation of :func:`nnxscale.layers.attention.attention`.
    """


_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, num_key_value_heads=8)
_BYTES = dict(vocab_size=256, rope_theta=10000.0, tie_word_embeddings=True)
_SCALING_3_1 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_SCALING_3_2 = dataclasses.replace(_SCALING_3_1, factor=32.0)

#: Published shapes (vocabulary 128256, context 131072) and byte-level sizes for CPU runs
#: (every width, head count and K/V head count divides by 8).
PRESETS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": LlamaConfig(**_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, rope_scaling=_SCALING_3_2, tie_word_embeddings=True),
    "llama-3.2-3b": LlamaConfig(**_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                num_attention_heads=24, rope_scaling=_SCALING_3_2, tie_word_embeddings=True),
    "llama-3.1-8b": LlamaConfig(**_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, rope_scaling=_SCALING_3_1, tie_word_embeddings=False),
    "llama-3.1-70b": LlamaConfig(**_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64, rope_scaling=_SCALING_3_1, tie_word_embeddings=False),
    "llama-tiny": LlamaConfig(**_BYTES, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=128),
    "llama-mini": LlamaConfig(**_BYTES, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=256),
}  # fmt: skip


def preset(name: str, **overrides) -> LlamaConfig:
    """The preset ``name`` with fields replaced by ``overrides`` (validated again)."""
    return choose_preset(PRESETS, "Llama", name, overrides)
