"""Hugging Face checkpoints of the decoder: one name map for every family, safetensors in
and out, and what every family's ``config.json`` shares.

A parameter's HF name is its path with the stacks unrolled into ``model.layers.{i}`` and
``kernel``/``scale``/``embedding`` read as ``weight``; a mixture's stacked experts become
``experts.{e}.<name>.weight`` one tensor per layer and expert (Mixtral's ``w1``/``w3``/``w2``,
the others' ``gate_proj``/``up_proj``/``down_proj``) and DeepSeek's router bias is
``gate.e_score_correction_bias``. HF's Linear weights are ``(out, in)``, ours ``(in, out)``;
attention projections hold heads as their own axis.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
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
from nnxscale.models.decoder.config import FULL, SLIDING, DecoderConfig
from nnxscale.models.decoder.rope import hf_scaling, parse_rope_scaling

_HEADS_IN = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj")  # (in, N, H) <- (N*H, in)
_LINEAR = ("gate_proj", "up_proj", "down_proj", "lm_head", "q_a_proj", "kv_a_proj_with_mqa", "gate")
_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # a buffer older checkpoints carry, not a parameter


def _layout(module: str, leaf: str, s: tuple[int, ...]) -> HFLayout:
    if module in _HEADS_IN:
        if leaf == "bias":  # (N, H) <- (N*H,)
            return HFLayout(((s[0], s[1]),), (0, 1))
        return HFLayout(((s[1], s[2]), (s[0],)), (2, 0, 1))
    if module == "o_proj" and leaf == "kernel":  # (N, H, C) <- (C, N*H)
        return HFLayout(((s[2],), (s[0], s[1])), (1, 2, 0))
    if module in _LINEAR and leaf == "kernel":
        return HFLayout.transposed(s)
    return HFLayout.same(s)  # embeddings, norm scales, biases (C,), the router's bias


def hf_param_of(config: DecoderConfig) -> Callable[[tuple, tuple[int, ...]], HFParam]:
    """``hf_param(path, shape)``: the HF tensors of each parameter of a decoder with ``config``."""
    segments = {seg.name: seg for seg in config.segments()}
    expert_names = {w: w for w in _EXPERTS} if getattr(config, "moe_name", "mlp") == "block_sparse_moe" else _EXPERTS

    def hf_param(path, shape: tuple[int, ...]) -> HFParam:
        parts = [key_part(k) for k in path]
        if parts[0] not in segments:
            name = ".".join(parts[:-1] + ["weight"])
            module = parts[-2]
            return HFParam((name if name == "lm_head.weight" else f"model.{name}",), _layout(module, parts[-1], shape))
        seg = segments[parts[0]]
        member, rest = 0, parts[1:]
        if len(seg.kinds) > 1:  # a group: layer_j
            member, rest = int(rest[0].split("_")[1]), rest[1:]
        layers = [seg.start + i * len(seg.kinds) + member for i in range(seg.groups)]
        leaf, module = rest[-1], rest[-2]
        if leaf in _EXPERTS and len(rest) == 2:  # a mixture's stacked experts (G, E, in, out)
            keys = tuple(f"model.layers.{i}.{module}.experts.{e}.{expert_names[leaf]}.weight" for i in layers
                         for e in range(shape[1]))  # fmt: skip
            return HFParam(keys, HFLayout.transposed(shape[2:]), stacked=True, depth=2)
        if leaf == "router_bias":
            name = ".".join(rest[:-1] + ["gate", "e_score_correction_bias"])
        else:
            name = ".".join(rest[:-1] + ["bias" if leaf == "bias" else "weight"])
        keys = tuple(f"model.layers.{i}.{name}" for i in layers)
        return HFParam(keys, _layout(module, leaf, shape[1:]), stacked=True)

    return hf_param


# ---- config.json ------------------------------------------------------------------------


def check_supported(hf: Mapping[str, Any], where, allowed: Mapping[str, tuple]) -> None:
    """A field that changes the network to something this decoder does not compute is an
    error naming it: ``allowed`` maps a field to the values supported (absent: the first)."""
    for name, values in allowed.items():
        value = hf.get(name, values[0])
        if value not in values:
            raise ModelError(f"{where}: {name}={value!r} is not supported (supported: {', '.join(map(repr, values))})")


def read_rope(hf: Mapping[str, Any], where) -> dict[str, Any]:
    """The rotary fields of a ``config.json`` as :class:`DecoderConfig` fields, read both as
    transformers 5 writes them (``rope_parameters``, flat or per layer type) and as most
    published checkpoints carry them (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``)."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and (FULL in params or SLIDING in params):
        full = params.get(FULL) or {}
        local = params.get(SLIDING)
        out = _one_rope(full, hf, f"{where}: rope_parameters.{FULL}")
        if local is not None:
            theta, scaling = _one_rope(local, hf, f"{where}: rope_parameters.{SLIDING}").values()
            out |= {"local_rope_theta": theta, "local_rope_scaling": scaling}
        return out
    out = _one_rope(params or hf.get("rope_scaling") or {}, hf, f"{where}: rope_scaling")
    if hf.get("rope_local_base_freq") is not None:  # Gemma 3 before transformers 5: plain rotation on the sliding layers
        out |= {"local_rope_theta": float(hf["rope_local_base_freq"]), "local_rope_scaling": None}
    return out


def _one_rope(d: Mapping[str, Any], hf: Mapping[str, Any], where: str) -> dict[str, Any]:
    theta = d.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = d.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelError(f"{where}: partial_rotary_factor={partial!r} is not supported (1.0 only)")
    scaling = {k: v for k, v in d.items() if k not in ("rope_theta",)}
    return {"rope_theta": float(theta), "rope_scaling": parse_rope_scaling(scaling or None, where)}


def write_rope(c: DecoderConfig) -> dict[str, Any]:
    """The rotary fields as published checkpoints carry them (transformers 4 and 5 read them)."""
    out = {"rope_theta": c.rope_theta, "rope_scaling": hf_scaling(c.rope_scaling)}
    if c.local_rope_theta is not None:
        out["rope_local_base_freq"] = c.local_rope_theta
    return out


def common_fields(hf: Mapping[str, Any], where, *, required=()) -> dict[str, Any]:
    """The fields every family's ``config.json`` spells the same way, as DecoderConfig fields."""
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads") + tuple(required)
    if missing := [k for k in names if hf.get(k) is None]:
        raise ModelError(f"{where} lacks the fields {missing}")
    N = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=N,
        num_key_value_heads=hf.get("num_key_value_heads") or N,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        head_dim=None if head_dim in (None, hf["hidden_size"] // N) else head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **read_rope(hf, where),
    )  # fmt: skip


def common_hf(c: DecoderConfig, model_type: str, architecture: str) -> dict[str, Any]:
    """What every family writes in ``config.json`` (a family adds its own fields)."""
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        **write_rope(c),
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": c.param_dtype,
        "use_cache": True,
    }


# ---- a family's checkpoints ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """How one family reads and writes Hugging Face directories: ``config_from_hf(hf, where)``
    -> DecoderConfig fields (``model_type`` checked by the caller), ``hf_config(config)`` ->
    ``config.json``, ``build(config, rngs=)`` -> the module, and ``text_prefixes``: prefixes
    of a multimodal checkpoint's text tower (read as ``model.``) and ``skipped`` prefixes of
    the tensors that are not the language model's (a vision tower)."""

    name: str
    model_types: tuple[str, ...]
    config_class: type
    config_from_hf: Callable[[dict, Any], dict]
    hf_config: Callable[[Any], dict]
    build: Callable[..., Any]
    text_prefixes: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()

    def config(self, hf: dict, where, *, param_dtype: str = "float32", dtype: Optional[str] = None):
        if hf.get("model_type") not in self.model_types:
            raise ModelError(f"{where}: model_type={hf.get('model_type')!r}, but this loader reads "
                             f"{self.name} checkpoints (model_type {' or '.join(map(repr, self.model_types))})")  # fmt: skip
        fields = self.config_from_hf(hf, where)
        return self.config_class(**fields, dtype=dtype or "float32", param_dtype=param_dtype)

    def pretrained_config(self, path):
        """The architecture of an HF directory, from its ``config.json`` alone (no weights read),
        with float32 parameters and the default run options: what ``--model DIR`` trains."""
        path = Path(path)
        return self.config(read_config(path, self.name), path / "config.json")

    def save_pretrained(self, model, path, *, max_shard_bytes: Optional[int] = 5 * 10**9) -> None:
        """Write ``path/config.json`` and the weights as HF's ``*ForCausalLM`` saves them: one
        tensor per layer (and expert), in the parameter dtype; past ``max_shard_bytes`` (HF's
        default 5 GB; ``None``: never) numbered files and ``model.safetensors.index.json``."""
        path = Path(path)
        save_safetensors(hf_tensors(model, hf_param_of(model.config)), path, max_shard_bytes=max_shard_bytes)
        (path / "config.json").write_text(json.dumps(self.hf_config(model.config), indent=2) + "\n")

    def _hf_name(self, key: str) -> Optional[str]:
        if key.endswith(_IGNORED_SUFFIXES) or key.startswith(self.skipped):
            return None
        for prefix in self.text_prefixes:
            if key.startswith(prefix):
                return "model." + key[len(prefix) :]
        return key if key.startswith("model.") or key == "lm_head.weight" else f"model.{key}"

    def from_pretrained(self, path, *, mesh=None, rules=None, dtype: Optional[str] = None):
        """Load an HF directory (``config.json`` and ``model.safetensors`` or a sharded set
        with ``model.safetensors.index.json``) into the decoder.

        Keys are HF's (``model.`` may be missing, as a bare ``*Model`` saves them); a
        ``lm_head.weight`` of a tied model must equal the embedding. Parameters keep the
        checkpoint's dtype when it is float32 or bfloat16 (otherwise they become float32);
        ``dtype`` sets the compute dtype (default float32). With ``mesh``, every array is
        created directly in the layout ``rules`` give on it: each device reads only its own
        slice from the files, no device holds a full tensor.
        """
        path = Path(path)
        hf, cfg_file = read_config(path, self.name), path / "config.json"
        with SafetensorsFiles(path) as files:
            names = {}  # HF name -> key in the files
            for key in files.keys():
                if (name := self._hf_name(key)) is not None:
                    names[name] = key
            embed = names.get("model.embed_tokens.weight")
            config = self.config(hf, cfg_file, param_dtype=files.param_dtype(embed) if embed else "float32", dtype=dtype)
            tied = names.pop("lm_head.weight", None) if config.tie_word_embeddings else None
            factory = lambda: self.build(config, rngs=nnx.Rngs(0))  # noqa: E731
            model = load_module(files, factory, hf_param_of(config), names, mesh=mesh, rules=rules, model_name=self.name)
            if tied is not None and not np.array_equal(files.tensor(tied), files.tensor(embed)):
                raise ModelError(
                    f"{files.where}: 'lm_head.weight' differs from the token embedding, but config.json says "
                    "tie_word_embeddings=true; set it to false to load a separate head"
                )
        return model
