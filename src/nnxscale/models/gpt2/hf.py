"""Hugging Face checkpoints of gpt2: safetensors in and out, and ``config.json``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
from flax import nnx

from nnxscale.errors import ModelError
from nnxscale.models.gpt2.config import GPT2Config
from nnxscale.models.gpt2.model import GPT2
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

_normal = nnx.initializers.normal
_zeros = nnx.initializers.zeros_init()
_ones = nnx.initializers.ones_init()


_LEAF_NAMES = {"embedding": "weight", "kernel": "weight", "scale": "weight", "bias": "bias"}
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # HF causal-mask buffers, not parameters


def _hf_param(path, shape: tuple[int, ...]) -> HFParam:
    """HF tensor names of one parameter, and how their Conv1D layout relates to ours.

    ``('wte', 'embedding')`` -> ``wte.weight``; the stacked ``('h', 'attn', 'c_attn',
    'kernel')`` of shape ``(L, C, 3, N, H)`` -> ``h.0.attn.c_attn.weight`` ...
    ``h.{L-1}...``, each ``(C, 3*N*H)``: heads are separate axes here, a reshape there.
    """
    parts = [key_part(k) for k in path]
    stacked = parts[0] == "h"
    name = ".".join(parts[1 if stacked else 0 : -1] + [_LEAF_NAMES[parts[-1]]])
    keys = tuple(f"h.{i}.{name}" for i in range(shape[0])) if stacked else (name,)
    s = shape[1:] if stacked else shape
    if name.endswith("attn.c_attn.weight"):  # (C, 3, N, H) <- (C, 3C)
        layout = HFLayout(((s[0],), tuple(s[1:])), tuple(range(len(s))))
    elif name.endswith("attn.c_attn.bias"):  # (3, N, H) <- (3C,)
        layout = HFLayout((tuple(s),), tuple(range(len(s))))
    elif name.endswith("attn.c_proj.weight"):  # (N, H, C) <- (C, C)
        layout = HFLayout((tuple(s[:-1]), (s[-1],)), tuple(range(len(s))))
    else:
        layout = HFLayout.same(s)
    return HFParam(keys, layout, stacked)


def _hf_config(config: GPT2Config) -> dict[str, Any]:
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size,
        "n_positions": config.n_positions,
        "n_ctx": config.n_positions,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "activation_function": "gelu_new",
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": 0.0,  # not applied here (see the module docstring)
        "initializer_range": 0.02,
    }


def _config_from_hf(hf: dict[str, Any], param_dtype: str, dtype: Optional[str], where: Path) -> GPT2Config:
    missing = [k for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head") if k not in hf]
    if missing:
        raise ModelError(f"{where} lacks the GPT-2 fields {missing}")
    unsupported = {
        "activation_function": (hf.get("activation_function", "gelu_new"), ("gelu_new", "gelu_pytorch_tanh")),
        "n_inner": (hf.get("n_inner"), (None, 4 * hf["n_embd"])),
        "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), (False,)),
        "tie_word_embeddings": (hf.get("tie_word_embeddings", True), (True,)),
    }
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ModelError(f"{where}: {name}={value!r} is not supported by this GPT-2 (supported: {allowed})")
    return GPT2Config(
        vocab_size=hf["vocab_size"], n_positions=hf["n_positions"], n_embd=hf["n_embd"],
        n_layer=hf["n_layer"], n_head=hf["n_head"], dropout=float(hf.get("resid_pdrop", 0.0)),
        layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        dtype=dtype or "float32", param_dtype=param_dtype,
    )  # fmt: skip


def pretrained_config(path) -> GPT2Config:
    """The architecture of an HF GPT-2 directory, from its ``config.json`` alone (no weights read),
    with float32 parameters and the default run options: what ``--model DIR`` trains."""
    path = Path(path)
    return _config_from_hf(read_config(path, "GPT-2"), "float32", None, path / "config.json")


def save_pretrained(model: GPT2, path) -> None:
    """Write ``path/config.json`` and ``path/model.safetensors`` in the HF GPT-2 layout.

    Keys are unprefixed as in the official checkpoint (``wte.weight``, ``h.0.attn.c_attn.weight``):
    the stacked blocks are written one tensor per block; the tied head is not written.
    Tensors keep the parameter dtype.
    """
    path = Path(path)
    save_safetensors(hf_tensors(model, _hf_param), path, max_shard_bytes=None)
    (path / "config.json").write_text(json.dumps(_hf_config(model.config), indent=2) + "\n")


def from_pretrained(path, *, mesh=None, rules=None, dtype: Optional[str] = None) -> GPT2:
    """Load an HF GPT-2 directory (``config.json`` + ``model.safetensors``) into a :class:`GPT2`.

    Keys may be unprefixed or start with ``transformer.``; ``lm_head.weight`` (tied: must
    equal ``wte.weight``) and the ``attn.bias``/``attn.masked_bias`` buffers are ignored.
    Parameters keep the checkpoint's dtype when it is float32 or bfloat16 (otherwise they
    become float32); ``dtype`` sets the compute dtype (``GPT2Config.dtype``, default float32).

    With ``mesh``, every array is created directly in the layout ``rules`` give on it:
    each device reads only its own slice from the file, no device holds a full tensor.
    """
    path = Path(path)
    hf, cfg_file = read_config(path, "GPT-2"), path / "config.json"

    with SafetensorsFiles(path) as files:
        names = {}  # unprefixed name -> key in the file
        for key in files.keys():
            name = key.removeprefix("transformer.")
            if not name.endswith(_IGNORED_SUFFIXES):
                names[name] = key
        tied = names.pop("lm_head.weight", None)
        param_dtype = files.param_dtype(names["wte.weight"]) if "wte.weight" in names else "float32"
        config = _config_from_hf(hf, param_dtype, dtype, cfg_file)
        factory = lambda: GPT2(config, rngs=nnx.Rngs(0))  # noqa: E731
        model = load_module(files, factory, _hf_param, names, mesh=mesh, rules=rules, model_name="GPT-2")
        if tied is not None and not np.array_equal(files.tensor(tied), files.tensor(names["wte.weight"])):
            raise ModelError(f"{files.where}: {tied!r} differs from the token embedding, but GPT-2 ties them")
    return model
