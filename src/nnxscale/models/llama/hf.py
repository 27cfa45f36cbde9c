"""Hugging Face checkpoints of llama: safetensors in and out, and ``config.json``.
"""
from __future__ import annotations

from typing import Any

from nnxscale.models.decoder.hf import HFFamily, check_supported, common_fields, common_hf
from nnxscale.models.llama.config import LlamaConfig
from nnxscale.models.llama.model import Llama


def config_from_hf(hf: dict[str, Any], where) -> dict[str, Any]:
    """A Llama ``config.json`` as decoder fields."""
    check_supported(hf, where, {"hidden_act": ("silu",), "mlp_bias": (False,)})
    bias = bool(hf.get("attention_bias", False))  # Llama's attention_bias: q, k, v and o
    return common_fields(hf, where, required=("max_position_embeddings",)) | {"qkv_bias": bias, "o_bias": bias}


def hf_config(c: LlamaConfig) -> dict[str, Any]:
    return common_hf(c, "llama", "LlamaForCausalLM") | {
        "hidden_act": "silu", "attention_bias": c.qkv_bias, "mlp_bias": False, "pretraining_tp": 1,
    }  # fmt: skip


HF = HFFamily("Llama", ("llama",), LlamaConfig, config_from_hf, hf_config, Llama)
from_pretrained, save_pretrained, pretrained_config = HF.from_pretrained, HF.save_pretrained, HF.pretrained_config
