"""Mistral (Jiang et al., 2023) as a configuration of the decoder: Llama's block with every
layer's attention over a sliding window of ``sliding_window`` tokens (v0.1: 4096; later
releases set none)."""
from __future__ import annotations

from typing import Any

from nnxscale.models.common.model_config import choose_preset
from nnxscale.models.decoder.config import DecoderConfig
from nnxscale.models.decoder.hf import HFFamily, check_supported, common_fields, common_hf
from nnxscale.models.decoder.model import Decoder


def config_from_hf(hf: dict[str, Any], where) -> dict[str, Any]:
    """A Mistral ``config.json`` as decoder fields."""
    check_supported(hf, where, {"hidden_act": ("silu",), "attention_bias": (False,)})
    return common_fields(hf, where) | {"sliding_window": hf.get("sliding_window")}


def hf_config(c: DecoderConfig) -> dict[str, Any]:
    return common_hf(c, "mistral", "MistralForCausalLM") | {"hidden_act": "silu", "sliding_window": c.sliding_window}


HF = HFFamily("Mistral", ("mistral",), DecoderConfig, config_from_hf, hf_config, Decoder)

#: Mistral 7B v0.1's published shape (7,241,732,096 parameters) and a byte-level size for CPU runs.
PRESETS: dict[str, DecoderConfig] = {
    "mistral-7b": DecoderConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                                rope_theta=10000.0, sliding_window=4096),
    "mistral-mini": DecoderConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                  rope_theta=10000.0, sliding_window=64, tie_word_embeddings=True),
}  # fmt: skip


def preset(name: str, **overrides) -> DecoderConfig:
    """The preset ``name`` with fields replaced by ``overrides`` (validated again)."""
    return choose_preset(PRESETS, "Mistral", name, overrides)


from_pretrained, save_pretrained, pretrained_config = HF.from_pretrained, HF.save_pretrained, HF.pretrained_config
__all__ = ["HF", "PRESETS", "config_from_hf", "from_pretrained", "hf_config", "pretrained_config", "preset", "save_pretrained"]
