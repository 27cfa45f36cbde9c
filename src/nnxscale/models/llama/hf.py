"""Hugging Face checkpoints of llama: safetensors in and out, and ``config.json``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
from flax import nnx

from nnxscale.errors import ModelError
from nnxscale.models.common.hf_checkpoint import (
    HFLayout,
    HFParam,
    SafetensorsFiles,
    hf_tensors,
    key_part,
    load_module,
    read_config,
    save_safetensors,
)  # fmt: skip
from nnxscale.models.llama.config import LlamaConfig, parse_rope_scaling
from nnxscale.models.llama.model import Llama

_normal = nnx.initializers.normal(0.02)  # HF's initializer_range for every weight matrix
_ones = nnx.initializers.ones_init()


_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # a buffer older checkpoints carry, not a parameter


def _hf_param(path, shape: tuple[int, ...]) -> HFParam:
    """HF tensor names of one parameter and how their layout relates to ours.

    ``('layers', 'self_attn', 'q_proj', 'kernel')`` of shape ``(L, C, N, H)`` ->
    ``model.layers.{i}.self_attn.q_proj.weight``, each ``(N*H, C)``. HF's Linear weights
    are ``(out, in)``, ours ``(in, out)``.
    """
    parts = [key_part(k) for k in path]
    stacked = parts[0] == "layers"
    name = ".".join(parts[1 if stacked else 0 : -1] + ["weight"])
    if stacked:
        keys = tuple(f"model.layers.{i}.{name}" for i in range(shape[0]))
    else:
        keys = (name if name == "lm_head.weight" else f"model.{name}",)
    s, module = (shape[1:] if stacked else shape), parts[-2]
    if module in ("q_proj", "k_proj", "v_proj"):  # (C, N, H) <- (N*H, C)
        layout = HFLayout(((s[1], s[2]), (s[0],)), (2, 0, 1))
    elif module == "o_proj":  # (N, H, C) <- (C, N*H)
        layout = HFLayout(((s[2],), (s[0], s[1])), (1, 2, 0))
    elif module in ("gate_proj", "up_proj", "down_proj", "lm_head"):  # (in, out) <- (out, in)
        layout = HFLayout.transposed(s)
    else:  # embedding (V, C), RMSNorm scales (C,)
        layout = HFLayout.same(s)
    return HFParam(keys, layout, stacked)


def _hf_config(c: LlamaConfig) -> dict[str, Any]:
    scaling = None if c.rope_scaling is None else {"rope_type": "llama3", **dataclasses.asdict(c.rope_scaling)}
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,  # not applied here (see the module docstring)
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "torch_dtype": c.param_dtype,
        "use_cache": True,
    }


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings")


def _config_from_hf(hf: dict[str, Any], param_dtype: str, dtype: Optional[str], where: Path) -> LlamaConfig:
    if hf.get("model_type", "llama") != "llama":
        raise ModelError(f"{where}: model_type={hf['model_type']!r}, but this loader reads Llama checkpoints (model_type 'llama')")
    if missing := [k for k in _REQUIRED if k not in hf]:
        raise ModelError(f"{where} lacks the Llama fields {missing}")
    # Transformers 5 writes rope_parameters (with rope_theta inside); earlier ones rope_theta and rope_scaling.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported = {
        "hidden_act": (hf.get("hidden_act", "silu"), ("silu",)),
        "attention_bias": (hf.get("attention_bias", False), (False,)),
        "mlp_bias": (hf.get("mlp_bias", False), (False,)),
        "rope_type": (rope_type, ("default", "llama3")),
        "partial_rotary_factor": (rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)), (1.0,)),
    }
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ModelError(f"{where}: {name}={value!r} is not supported by this Llama (supported: {allowed})")
    N = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    return LlamaConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=N,
        num_key_value_heads=hf.get("num_key_value_heads") or N,
        max_position_embeddings=hf["max_position_embeddings"],
        head_dim=None if head_dim in (None, hf["hidden_size"] // N) else head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=parse_rope_scaling(rope, f"{where}: rope_scaling") if rope_type == "llama3" else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype or "float32", param_dtype=param_dtype,
    )  # fmt: skip


def pretrained_config(path) -> LlamaConfig:
    """The architecture of an HF Llama directory, from its ``config.json`` alone (no weights read),
    with float32 parameters and the default run options: what ``--model DIR`` trains."""
    path = Path(path)
    return _config_from_hf(read_config(path, "Llama"), "float32", None, path / "config.json")


def save_pretrained(model: Llama, path, *, max_shard_bytes: Optional[int] = 5 * 10**9) -> None:
    """Write ``path/config.json`` and the weights as HF's ``LlamaForCausalLM`` saves them.

    Names as in HF (``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``
    of shape (N*H, C), ..., ``lm_head.weight`` when untied), one tensor per layer, in the
    parameter dtype. One ``model.safetensors``, or, past ``max_shard_bytes`` (HF's default
    5 GB; ``None``: never), numbered files and ``model.safetensors.index.json``.
    """
    path = Path(path)
    save_safetensors(hf_tensors(model, _hf_param), path, max_shard_bytes=max_shard_bytes)
    (path / "config.json").write_text(json.dumps(_hf_config(model.config), indent=2) + "\n")


def from_pretrained(path, *, mesh=None, rules=None, dtype: Optional[str] = None) -> Llama:
    """Load an HF Llama directory (``config.json`` and ``model.safetensors`` or a sharded
    set with ``model.safetensors.index.json``) into a :class:`Llama`.

    Keys are HF's (``model.`` may be missing, as a ``LlamaModel`` saves them); a
    ``lm_head.weight`` of a tied model must equal the embedding. Parameters keep the
    checkpoint's dtype when it is float32 or bfloat16 (otherwise they become float32);
    ``dtype`` sets the compute dtype (``LlamaConfig.dtype``, default float32).

    With ``mesh``, every array is created directly in the layout ``rules`` give on it:
    each device reads only its own slice from the files, no device holds a full tensor.
    """
    return load_pretrained(path, "Llama", _config_from_hf, Llama, _hf_param, mesh=mesh, rules=rules, dtype=dtype)


def load_pretrained(path, family: str, config_from_hf, build, hf_param, *, mesh, rules, dtype: Optional[str]):
    """An HF directory of a Llama-like family (``family`` names it in errors) as ``build(config)``:
    ``config_from_hf(hf config, param dtype, dtype, where)`` reads its architecture,
    ``hf_param`` names each parameter's tensors (see :func:`from_pretrained`)."""
    path = Path(path)
    hf, cfg_file = read_config(path, family), path / "config.json"
    with SafetensorsFiles(path) as files:
        names = {}  # HF name -> key in the files
        for key in files.keys():
            if not key.endswith(_IGNORED_SUFFIXES):
                names[key if key.startswith("model.") or key == "lm_head.weight" else f"model.{key}"] = key
        embed = names.get("model.embed_tokens.weight")
        config = config_from_hf(hf, files.param_dtype(embed) if embed else "float32", dtype, cfg_file)
        tied = names.pop("lm_head.weight", None) if config.tie_word_embeddings else None
        factory = lambda: build(config, rngs=nnx.Rngs(0))  # noqa: E731
        model = load_module(files, factory, hf_param, names, mesh=mesh, rules=rules, model_name=family)
        if tied is not None and not np.array_equal(files.tensor(tied), files.tensor(embed)):
            raise ModelError(
                f"{files.where}: 'lm_head.weight' differs from the token embedding, but config.json says "
                "tie_word_embeddings=true; set it to false to load a separate head"
            )
    return model
