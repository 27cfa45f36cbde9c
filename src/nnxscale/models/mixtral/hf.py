"""Hugging Face checkpoints of mixtral: safetensors in and out, and ``config.json``.

Names as the published ``MixtralForCausalLM`` checkpoints store them: Llama's for attention
and norms, ``model.layers.{i}.block_sparse_moe.gate.weight`` (E, C) for the router and
``model.layers.{i}.block_sparse_moe.experts.{e}.w1|w2|w3.weight`` for each expert (HF's
Linear layout, ``(out, in)``). Our experts are one stacked tensor per layer set,
``(layers, experts, ...)``: each device reads its own layers' and experts' tensors.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from nnxscale.errors import ModelError
from nnxscale.models.common.hf_checkpoint import (
    HFLayout,
    HFParam,
    hf_tensors,
    key_part,
    read_config,
    save_safetensors,
)  # fmt: skip
from nnxscale.models.llama import hf as llama_hf
from nnxscale.models.mixtral.config import MixtralConfig
from nnxscale.models.mixtral.model import Mixtral


def _hf_param(path, shape: tuple[int, ...]) -> HFParam:
    """HF tensor names of one parameter: the experts' ``(L, E, in, out)`` ->
    ``model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight`` ``(out, in)`` each; the router
    ``(L, C, E)`` -> ``...block_sparse_moe.gate.weight`` ``(E, C)``; the rest as Llama's."""
    parts = [key_part(k) for k in path]
    if parts[:2] == ["layers", "block_sparse_moe"] and parts[2] in ("w1", "w2", "w3"):
        L, E = shape[:2]
        keys = tuple(f"model.layers.{i}.block_sparse_moe.experts.{e}.{parts[2]}.weight" for i in range(L) for e in range(E))
        return HFParam(keys, HFLayout.transposed(shape[2:]), stacked=True, depth=2)
    if parts[:3] == ["layers", "block_sparse_moe", "gate"]:
        keys = tuple(f"model.layers.{i}.block_sparse_moe.gate.weight" for i in range(shape[0]))
        return HFParam(keys, HFLayout.transposed(shape[1:]), stacked=True)
    return llama_hf._hf_param(path, shape)


def _hf_config(c: MixtralConfig) -> dict[str, Any]:
    hf = llama_hf._hf_config(c)
    for name in ("rope_scaling", "mlp_bias", "pretraining_tp", "attention_bias"):
        hf.pop(name, None)
    return hf | {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": c.num_local_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "router_aux_loss_coef": c.router_aux_loss_coef,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "output_router_logits": False,
    }


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings", "num_local_experts", "num_experts_per_tok")  # fmt: skip


def _config_from_hf(hf: dict[str, Any], param_dtype: str, dtype: Optional[str], where: Path) -> MixtralConfig:
    if hf.get("model_type") != "mixtral":
        raise ModelError(f"{where}: model_type={hf.get('model_type')!r}, but this loader reads Mixtral checkpoints")
    if missing := [k for k in _REQUIRED if k not in hf]:
        raise ModelError(f"{where} lacks the Mixtral fields {missing}")
    unsupported = {
        "hidden_act": (hf.get("hidden_act", "silu"), ("silu",)),
        "router_jitter_noise": (hf.get("router_jitter_noise", 0.0), (0, 0.0)),
        "sliding_window": (hf.get("sliding_window"), (None,)),
    }
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ModelError(f"{where}: {name}={value!r} is not supported by this Mixtral (supported: {allowed})")
    llama = llama_hf._config_from_hf(hf | {"model_type": "llama"}, param_dtype, dtype, where)
    fields = {k: getattr(llama, k) for k in llama.__dataclass_fields__}
    return MixtralConfig(**fields, num_local_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                         router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.02)))  # fmt: skip


def pretrained_config(path) -> MixtralConfig:
    """The architecture of an HF Mixtral directory, from its ``config.json`` alone (no weights
    read), with float32 parameters and the default run options: what ``--model DIR`` trains."""
    path = Path(path)
    return _config_from_hf(read_config(path, "Mixtral"), "float32", None, path / "config.json")


def save_pretrained(model: Mixtral, path, *, max_shard_bytes: Optional[int] = 5 * 10**9) -> None:
    """Write ``path/config.json`` and the weights as HF's ``MixtralForCausalLM`` checkpoints
    hold them (one tensor per layer and expert), in the parameter dtype; past
    ``max_shard_bytes`` numbered files and ``model.safetensors.index.json``."""
    path = Path(path)
    save_safetensors(hf_tensors(model, _hf_param), path, max_shard_bytes=max_shard_bytes)
    (path / "config.json").write_text(json.dumps(_hf_config(model.config), indent=2) + "\n")


def from_pretrained(path, *, mesh=None, rules=None, dtype: Optional[str] = None) -> Mixtral:
    """Load an HF Mixtral directory into a :class:`Mixtral`, as
    :func:`nnxscale.models.llama.from_pretrained` does a Llama: each device reads only its
    slice (its layers' and experts' tensors) straight into the layout ``rules`` give on ``mesh``."""
    return llama_hf.load_pretrained(path, "Mixtral", _config_from_hf, Mixtral, _hf_param, mesh=mesh, rules=rules,
                                    dtype=dtype)  # fmt: skip
