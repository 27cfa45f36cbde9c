"""Hugging Face checkpoints of mixtral: safetensors in and out, and ``config.json``.

Names as the published ``MixtralForCausalLM`` checkpoints store them: Llama's for attention
and norms, ``model.layers.{i}.block_sparse_moe.gate.weight`` (E, C) for the router and
``model.layers.{i}.block_sparse_moe.experts.{e}.w1|w2|w3.weight`` for each expert (HF's
Linear layout, ``(out, in)``). Our experts are one stacked tensor per layer set,
``(layers, experts, ...)``: each device reads its own layers' and experts' tensors.
"""
from __future__ import annotations

from typing import Any

from nnxscale.models.decoder.hf import HFFamily, check_supported, common_fields, common_hf
from nnxscale.models.mixtral.config import MixtralConfig
from nnxscale.models.mixtral.model import Mixtral


def config_from_hf(hf: dict[str, Any], where) -> dict[str, Any]:
    """A Mixtral ``config.json`` as decoder fields."""
    check_supported(hf, where, {"hidden_act": ("silu",), "router_jitter_noise": (0.0, 0), "sliding_window": (None,)})
    fields = common_fields(hf, where, required=("max_position_embeddings", "num_local_experts", "num_experts_per_tok"))
    return fields | {"num_local_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
                     "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.02))}  # fmt: skip


def hf_config(c: MixtralConfig) -> dict[str, Any]:
    hf = common_hf(c, "mixtral", "MixtralForCausalLM")
    hf.pop("rope_scaling")
    return hf | {
        "hidden_act": "silu",
        "num_local_experts": c.num_local_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "router_aux_loss_coef": c.router_aux_loss_coef,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "output_router_logits": False,
    }


HF = HFFamily("Mixtral", ("mixtral",), MixtralConfig, config_from_hf, hf_config, Mixtral)
from_pretrained, save_pretrained, pretrained_config = HF.from_pretrained, HF.save_pretrained, HF.pretrained_config
