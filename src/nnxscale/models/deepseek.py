"""DeepSeek-V3 and DeepSeek-V2 (V2-Lite) as configurations of the decoder: multi-head
latent attention, the first ``first_k_dense_replace`` layers dense, then a mixture of
``n_routed_experts`` with ``n_shared_experts`` always on, sigmoid scores with
``e_score_correction_bias`` for the choice, group-limited top-k (``n_group``,
``topk_group``), weights renormalized (``norm_topk_prob``) and scaled by
``routed_scaling_factor``; V2's router (``deepseek_v2``) takes softmax scores, never
renormalized, groups scored by their best expert, and no bias. The multi-token-prediction layer of the published checkpoints
(``num_nextn_predict_layers``) is not part of the network trained here: its tensors
(``model.layers.{num_hidden_layers}.*``) are left out when loading.
"""
from __future__ import annotations

from typing import Any

from nnxscale.errors import ModelError
from nnxscale.models.common.model_config import choose_preset
from nnxscale.models.decoder.config import DecoderConfig
from nnxscale.models.decoder.hf import HFFamily, check_supported, common_fields, common_hf
from nnxscale.models.decoder.model import Decoder
from nnxscale.models.decoder.rope import YarnScaling

_LATENT = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def config_from_hf(hf: dict[str, Any], where) -> dict[str, Any]:
    """A DeepSeek-V3 ``config.json`` as decoder fields."""
    check_supported(hf, where, {"hidden_act": ("silu",), "attention_bias": (False,), "moe_layer_freq": (1,)})
    fields = common_fields(hf, where, required=_LATENT + ("n_routed_experts", "moe_intermediate_size"))
    fields.pop("head_dim")  # latent attention's head widths are its own fields
    return fields | {k: hf[k] for k in _LATENT} | {
        "q_lora_rank": hf.get("q_lora_rank"), "rope_interleave": bool(hf.get("rope_interleave", True)),
        "num_local_experts": hf["n_routed_experts"], "num_experts_per_tok": hf.get("num_experts_per_tok", 8),
        "moe_intermediate_size": hf["moe_intermediate_size"], "n_shared_experts": hf.get("n_shared_experts") or 0,
        "dense_layers": tuple(range(hf.get("first_k_dense_replace", 0))),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
    } | _router(hf, where)  # fmt: skip


def _router(hf: dict[str, Any], where) -> dict[str, Any]:
    if hf.get("model_type") == "deepseek_v2":
        # transformers' DeepseekV2TopkRouter: softmax scores, never renormalized; with
        # group_limited_greedy a group is scored by its best expert
        check_supported(hf, where, {"topk_method": ("greedy", "group_limited_greedy")})
        grouped = hf.get("topk_method", "greedy") == "group_limited_greedy"
        return {"router_scoring": "softmax", "router_score_bias": False, "norm_topk_prob": False, "router_group_top": 1,
                "n_group": (hf.get("n_group") or 1) if grouped else 1, "topk_group": (hf.get("topk_group") or 1) if grouped else 1}  # fmt: skip
    # transformers' DeepseekV3TopkRouter reads neither scoring_func nor topk_method: always
    # sigmoid scores, the correction bias for the choice, groups by their best two
    return {"router_scoring": "sigmoid", "router_score_bias": True, "n_group": hf.get("n_group") or 1,
            "topk_group": hf.get("topk_group") or 1, "norm_topk_prob": bool(hf.get("norm_topk_prob", True))}  # fmt: skip


def hf_config(c: DecoderConfig) -> dict[str, Any]:
    v2 = c.router_scoring == "softmax" and not c.router_score_bias and not c.norm_topk_prob and c.router_group_top == 1
    v3 = c.router_scoring == "sigmoid" and c.router_score_bias and c.router_group_top == 2
    if not (v2 or v3):
        raise ModelError("a DeepSeek checkpoint routes as transformers' DeepseekV3TopkRouter (sigmoid scores, a "
                         "correction bias, groups by their best two) or DeepseekV2TopkRouter (softmax, no "
                         "renormalization, groups by their best one); this config routes otherwise")  # fmt: skip
    if v2:
        return _v2_config(c)
    hf = common_hf(c, "deepseek_v3", "DeepseekV3ForCausalLM")
    hf.pop("head_dim")
    return hf | {k: getattr(c, k) for k in _LATENT} | {
        "q_lora_rank": c.q_lora_rank, "rope_interleave": c.rope_interleave, "hidden_act": "silu",
        "n_routed_experts": c.num_local_experts, "num_experts_per_tok": c.num_experts_per_tok,
        "moe_intermediate_size": c.expert_size, "n_shared_experts": c.n_shared_experts,
        "first_k_dense_replace": len(c.dense_layers), "n_group": c.n_group, "topk_group": c.topk_group,
        "norm_topk_prob": c.norm_topk_prob, "routed_scaling_factor": c.routed_scaling_factor,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "attention_bias": False, "num_nextn_predict_layers": 0,
    }  # fmt: skip


def _v2_config(c: DecoderConfig) -> dict[str, Any]:
    hf = common_hf(c, "deepseek_v2", "DeepseekV2ForCausalLM")
    hf.pop("head_dim")
    return hf | {k: getattr(c, k) for k in _LATENT} | {
        "q_lora_rank": c.q_lora_rank, "hidden_act": "silu", "n_routed_experts": c.num_local_experts,
        "num_experts_per_tok": c.num_experts_per_tok, "moe_intermediate_size": c.expert_size,
        "n_shared_experts": c.n_shared_experts, "first_k_dense_replace": len(c.dense_layers),
        "n_group": c.n_group, "topk_group": c.topk_group, "routed_scaling_factor": c.routed_scaling_factor,
        "topk_method": "group_limited_greedy" if c.n_group > 1 else "greedy", "attention_bias": False,
    }  # fmt: skip


HF = HFFamily("DeepSeek", ("deepseek_v3", "deepseek_v2"), DecoderConfig, config_from_hf, hf_config, Decoder)

_YARN = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)

#: The published shapes (their ``config.json``; tools/published_counts.json holds the
#: reference's parameter counts) and a byte-level size for CPU runs.
PRESETS: dict[str, DecoderConfig] = {
    "deepseek-v3": DecoderConfig(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                                 num_attention_heads=128, num_key_value_heads=128, max_position_embeddings=163840,
                                 rms_norm_eps=1e-6, rope_theta=10000.0,
                                 rope_scaling=YarnScaling(**_YARN, mscale=1.0, mscale_all_dim=1.0),
                                 q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                 v_head_dim=128, rope_interleave=True, num_local_experts=256, num_experts_per_tok=8,
                                 moe_intermediate_size=2048, n_shared_experts=1, dense_layers=(0, 1, 2),
                                 router_scoring="sigmoid", router_score_bias=True, n_group=8, topk_group=4,
                                 norm_topk_prob=True, routed_scaling_factor=2.5),
    "deepseek-v2-lite": DecoderConfig(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=163840,
                                      rms_norm_eps=1e-6, rope_theta=10000.0,
                                      rope_scaling=YarnScaling(**_YARN, mscale=0.707, mscale_all_dim=0.707),
                                      kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                      rope_interleave=True, num_local_experts=64, num_experts_per_tok=6,
                                      moe_intermediate_size=1408, n_shared_experts=2, dense_layers=(0,),
                                      router_scoring="softmax", norm_topk_prob=False, router_group_top=1),
    "deepseek-mini": DecoderConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=5,
                                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, q_lora_rank=64,
                                   kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                                   rope_interleave=True, num_local_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=64, n_shared_experts=1, dense_layers=(0,),
                                   router_scoring="sigmoid", router_score_bias=True, n_group=4, topk_group=2,
                                   norm_topk_prob=True, routed_scaling_factor=2.5),
}  # fmt: skip


def preset(name: str, **overrides) -> DecoderConfig:
    """The preset ``name`` with fields replaced by ``overrides`` (validated again)."""
    return choose_preset(PRESETS, "DeepSeek", name, overrides)


from_pretrained, save_pretrained, pretrained_config = HF.from_pretrained, HF.save_pretrained, HF.pretrained_config
__all__ = ["HF", "PRESETS", "config_from_hf", "from_pretrained", "hf_config", "pretrained_config", "preset", "save_pretrained"]
