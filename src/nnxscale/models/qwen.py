"""Qwen2, Qwen3 and Qwen3-MoE (Alibaba's Qwen team) as configurations of the decoder.

- ``qwen2``: Llama's block with biases on q, k and v.
- ``qwen3``: q/k RMSNorm per head, no biases, ``head_dim`` its own (128 at every size).
- ``qwen3_moe``: Qwen3's attention and a mixture of ``num_experts`` experts of
  ``moe_intermediate_size``, softmax top-k, renormalized when ``norm_topk_prob``; the layers
  in ``mlp_only_layers``, and those off ``decoder_sparse_step``, keep a dense MLP.

Sliding windows (``use_sliding_window``) apply to layers from ``max_window_layers`` on, as
transformers lays them out (``layer_types``).
"""
from __future__ import annotations

from typing import Any

from nnxscale.models.common.model_config import choose_preset
from nnxscale.models.decoder.config import FULL, SLIDING, DecoderConfig
from nnxscale.models.decoder.hf import HFFamily, check_supported, common_fields, common_hf
from nnxscale.models.decoder.model import Decoder


def _windows(hf: dict[str, Any], L: int) -> dict[str, Any]:
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return {}
    types = hf.get("layer_types") or [SLIDING if i >= hf.get("max_window_layers", L) else FULL for i in range(L)]
    return {"sliding_window": hf["sliding_window"], "layer_types": tuple(types)}


def config_from_hf(hf: dict[str, Any], where) -> dict[str, Any]:
    """A Qwen2/Qwen3/Qwen3-MoE ``config.json`` as decoder fields."""
    kind = hf.get("model_type")
    check_supported(hf, where, {"hidden_act": ("silu",)})
    fields = common_fields(hf, where) | _windows(hf, hf.get("num_hidden_layers", 0))
    if kind == "qwen2":
        return fields | {"qkv_bias": True}
    check_supported(hf, where, {"attention_bias": (False,)})
    fields |= {"qk_norm": True}
    if kind == "qwen3":
        return fields
    L = fields["num_hidden_layers"]
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    step = hf.get("decoder_sparse_step", 1) or 1
    only = set(hf.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(L) if i in only or not (experts and (i + 1) % step == 0))  # transformers' rule
    return fields | {
        "num_local_experts": experts, "num_experts_per_tok": hf.get("num_experts_per_tok", 8),
        "moe_intermediate_size": hf.get("moe_intermediate_size"), "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "dense_layers": dense, "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }  # fmt: skip


_ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def model_type(c: DecoderConfig) -> str:
    return "qwen3_moe" if c.num_local_experts else "qwen3" if c.qk_norm else "qwen2"


def hf_config(c: DecoderConfig) -> dict[str, Any]:
    kind = model_type(c)
    hf = common_hf(c, kind, _ARCH[kind]) | {"hidden_act": "silu", "use_sliding_window": c.sliding_window is not None,
                                            "sliding_window": c.sliding_window, "layer_types": list(c.attention_types()),
                                            "max_window_layers": c.num_hidden_layers}  # fmt: skip
    if kind != "qwen2":
        hf["attention_bias"] = False
    if kind == "qwen3_moe":
        L = c.num_hidden_layers
        hf |= {"num_experts": c.num_local_experts, "num_experts_per_tok": c.num_experts_per_tok,
               "moe_intermediate_size": c.expert_size, "norm_topk_prob": c.norm_topk_prob, "decoder_sparse_step": 1,
               "mlp_only_layers": [i for i in range(L) if i in set(c.dense_layers)],
               "router_aux_loss_coef": c.router_aux_loss_coef}  # fmt: skip
    return hf


HF = HFFamily("Qwen", tuple(_ARCH), DecoderConfig, config_from_hf, hf_config, Decoder)

_QWEN3 = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
              head_dim=128, qk_norm=True)  # fmt: skip
_BYTES = dict(vocab_size=256, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)

#: The published Qwen3 shapes (their ``config.json``: tools/published_counts.json holds the
#: parameter counts the reference implementation gives) and byte-level sizes for CPU runs.
PRESETS: dict[str, DecoderConfig] = {
    "qwen3-0.6b": DecoderConfig(**_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": DecoderConfig(**_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                              num_attention_heads=32, num_key_value_heads=8),
    "qwen3-32b": DecoderConfig(**_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                               num_attention_heads=64, num_key_value_heads=8),
    "qwen3-30b-a3b": DecoderConfig(**_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                   num_attention_heads=32, num_key_value_heads=4, num_local_experts=128,
                                   num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                                   router_aux_loss_coef=0.001),
    "qwen3-235b-a22b": DecoderConfig(**_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                                     num_attention_heads=64, num_key_value_heads=4, num_local_experts=128,
                                     num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True,
                                     router_aux_loss_coef=0.001),
    "qwen3-mini": DecoderConfig(**_BYTES, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=32, qk_norm=True,
                                max_position_embeddings=256),
    "qwen3-moe-mini": DecoderConfig(**_BYTES, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=16, qk_norm=True,
                                    max_position_embeddings=256, num_local_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=64, norm_topk_prob=True, router_aux_loss_coef=0.001),
}  # fmt: skip


def preset(name: str, **overrides) -> DecoderConfig:
    """The preset ``name`` with fields replaced by ``overrides`` (validated again)."""
    return choose_preset(PRESETS, "Qwen", name, overrides)


from_pretrained, save_pretrained, pretrained_config = HF.from_pretrained, HF.save_pretrained, HF.pretrained_config
__all__ = ["HF", "PRESETS", "config_from_hf", "from_pretrained", "hf_config", "pretrained_config", "preset", "save_pretrained"]
