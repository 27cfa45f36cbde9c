"""Gemma 2 and Gemma 3 (Google DeepMind) as configurations of the decoder.

Both: RMSNorm scaling by ``1 + w``, norms before and after the attention and the MLP, the
embedding times ``sqrt(hidden_size)``, GeGLU with tanh GELU, the softmax scale
``query_pre_attn_scalar**-0.5``, a tied head, sliding-window layers among global ones
(``layer_types``; Gemma 2 alternates, Gemma 3 has five sliding layers to one global).
Gemma 2 soft-caps the attention logits (``attn_logit_softcapping``) and the final logits
(``final_logit_softcapping``); Gemma 3 norms each query and key head instead and rotates its
sliding layers with their own base (``rope_local_base_freq``). A ``gemma3`` checkpoint (the
multimodal ``Gemma3ForConditionalGeneration``) loads its text tower; its vision tower is
left out, and it saves as ``gemma3_text``.
"""
from __future__ import annotations

from typing import Any

from nnxscale.models.common.model_config import choose_preset
from nnxscale.models.decoder.config import FULL, SLIDING, DecoderConfig
from nnxscale.models.decoder.hf import HFFamily, check_supported, common_fields, common_hf
from nnxscale.models.decoder.model import Decoder
from nnxscale.models.decoder.rope import LinearScaling


# What transformers' Gemma2Config / Gemma3TextConfig take for a field a published config.json
# leaves out (gemma-3-27b's text_config names no vocabulary size, for one).
_GEMMA2_DEFAULTS = {"vocab_size": 256000, "max_position_embeddings": 8192, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
_GEMMA3_DEFAULTS = {"vocab_size": 262208, "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                    "rope_local_base_freq": 10000.0}  # fmt: skip


def config_from_hf(hf: dict[str, Any], where) -> dict[str, Any]:
    """A Gemma 2 / Gemma 3 ``config.json`` as decoder fields (a ``gemma3`` one: its ``text_config``)."""
    if hf.get("model_type") == "gemma3":
        tie = hf.get("tie_word_embeddings", hf.get("text_config", {}).get("tie_word_embeddings", True))
        hf = {**hf.get("text_config", {}), "tie_word_embeddings": tie}
        where = f"{where} (text_config)"
    gemma3 = hf.get("model_type", "gemma3_text") != "gemma2"
    hf = (_GEMMA3_DEFAULTS if gemma3 else _GEMMA2_DEFAULTS) | {k: v for k, v in hf.items() if v is not None or k.endswith("softcapping")}
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    check_supported({"hidden_activation": act, **hf}, where, {"hidden_activation": ("gelu_pytorch_tanh",),
                                                              "attention_bias": (False,),
                                                              "use_bidirectional_attention": (False, None)})  # fmt: skip
    L = hf.get("num_hidden_layers", 0)
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6 if gemma3 else 2))
    types = hf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(L)]
    fields = common_fields(hf | {"tie_word_embeddings": hf.get("tie_word_embeddings", True)}, where)
    return fields | {
        "head_dim": hf.get("head_dim", 256), "sliding_window": hf.get("sliding_window"), "layer_types": tuple(types),
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
        "attn_logit_softcapping": hf.get("attn_logit_softcapping"), "final_logit_softcapping": hf.get("final_logit_softcapping"),
        "norm_offset": True, "sandwich_norms": True, "embedding_scale": True, "hidden_act": "gelu_pytorch_tanh",
        "qk_norm": gemma3,
    }  # fmt: skip


def hf_config(c: DecoderConfig) -> dict[str, Any]:
    kind = "gemma3_text" if c.qk_norm else "gemma2"
    hf = common_hf(c, kind, "Gemma3ForCausalLM" if c.qk_norm else "Gemma2ForCausalLM")
    return hf | {
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": c.query_pre_attn_scalar,
        "sliding_window": c.sliding_window, "layer_types": list(c.attention_types()),
        "attn_logit_softcapping": c.attn_logit_softcapping, "final_logit_softcapping": c.final_logit_softcapping,
        "attention_bias": False,
    }  # fmt: skip


HF = HFFamily("Gemma", ("gemma2", "gemma3_text", "gemma3"), DecoderConfig, config_from_hf, hf_config, Decoder,
              text_prefixes=("language_model.model.", "model.language_model."),
              skipped=("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."))  # fmt: skip

_GEMMA = dict(norm_offset=True, sandwich_norms=True, embedding_scale=True, hidden_act="gelu_pytorch_tanh",
              tie_word_embeddings=True, rms_norm_eps=1e-6)  # fmt: skip


def _pattern(layers: int, every: int) -> tuple[str, ...]:
    return tuple(SLIDING if (i + 1) % every else FULL for i in range(layers))


#: The published shapes (their ``config.json``; tools/published_counts.json holds the
#: reference's parameter counts) and byte-level sizes for CPU runs.
PRESETS: dict[str, DecoderConfig] = {
    "gemma-2-9b": DecoderConfig(**_GEMMA, vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                                num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                max_position_embeddings=8192, rope_theta=10000.0, sliding_window=4096,
                                layer_types=_pattern(42, 2), query_pre_attn_scalar=256,
                                attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma-3-1b": DecoderConfig(**_GEMMA, vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                max_position_embeddings=32768, rope_theta=1000000.0, local_rope_theta=10000.0,
                                sliding_window=512, layer_types=_pattern(26, 6), query_pre_attn_scalar=256, qk_norm=True),
    "gemma-3-27b": DecoderConfig(**_GEMMA, vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                                 num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                                 max_position_embeddings=131072, rope_theta=1000000.0,
                                 rope_scaling=LinearScaling(factor=8.0), local_rope_theta=10000.0,
                                 sliding_window=1024, layer_types=_pattern(62, 6), query_pre_attn_scalar=168,
                                 qk_norm=True),
    "gemma3-mini": DecoderConfig(**_GEMMA, vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=14,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
                                 rope_theta=1000000.0, local_rope_theta=10000.0, sliding_window=32,
                                 layer_types=_pattern(14, 6), query_pre_attn_scalar=32, qk_norm=True),
    "gemma2-mini": DecoderConfig(**_GEMMA, vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
                                 rope_theta=10000.0, sliding_window=32, layer_types=_pattern(4, 2),
                                 query_pre_attn_scalar=32, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
}  # fmt: skip


def preset(name: str, **overrides) -> DecoderConfig:
    """The preset ``name`` with fields replaced by ``overrides`` (validated again)."""
    return choose_preset(PRESETS, "Gemma", name, overrides)


from_pretrained, save_pretrained, pretrained_config = HF.from_pretrained, HF.save_pretrained, HF.pretrained_config
__all__ = ["HF", "PRESETS", "config_from_hf", "from_pretrained", "hf_config", "pretrained_config", "preset", "save_pretrained"]
