"""A LoRA run out of nnxscale: its adapters as a PEFT adapter, or merged into a full Hugging Face model.

``nnxscale export --run-dir R --peft DIR`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` as Hugging Face PEFT saves a LoRA adapter: PEFT loads them
onto the base model (``PeftModel.from_pretrained(base, DIR)``) and computes the logits
nnxscale's model does. ``--merged DIR`` folds every adapter into its weight
(``W + alpha/r A B``) and writes the base as a whole Hugging Face directory, with the
family's own ``save_pretrained``.

The adapters' tensors take the names and layout of the weights they adapt in the family's
Hugging Face export (``_hf_param``): PEFT's ``lora_A.weight`` is ``(r, in)`` and
``lora_B.weight`` ``(out, r)``, the in and out dimensions flattened as HF flattens the weight's.
A mixture's MLP adapters are written for the fused experts transformers 5 builds
(:func:`peft_adapter`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from nnxscale.errors import ConfigError
from nnxscale.layers import lora
from nnxscale.models import is_pretrained_dir
from nnxscale.training.config import TrainConfig
from nnxscale.training.inputs import pretrained_source
from nnxscale.training.rundir import saved_config
from nnxscale.training.sampling import restore_model, sampling_mesh

#: Files of a Hugging Face directory besides the weights that a merged export copies from the base.
_HF_EXTRAS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
              "chat_template.jinja")  # fmt: skip


#: A routed expert's projection in a family's per-expert Hugging Face names: the module
#: holding the experts, the expert, and which of the three products it is.
_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_MLP = re.compile(r"\.(gate_proj|up_proj|down_proj)$")


@dataclasses.dataclass
class PeftAdapter:
    """What ``export --peft`` writes: the tensors and the fields of ``adapter_config.json``
    that depend on them."""

    tensors: dict[str, np.ndarray]
    target_modules: list[str]
    target_parameters: list[str] = dataclasses.field(default_factory=list)
    rank_pattern: dict[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: dict[str, float] = dataclasses.field(default_factory=dict)


def peft_tensors(model, names) -> tuple[dict[str, np.ndarray], list[str]]:
    """``({PEFT key: array}, target module names)`` of every adapter of ``model``, named by the
    family's :class:`~nnxscale.models.LoraNames` ``names``, one module per Hugging Face weight
    (a mixture's experts one by one, as transformers 4 held them)."""
    adapters = _adapters(model, names)
    tensors = {}
    for module_key, (a, b) in adapters.items():
        tensors[f"base_model.model.{module_key}.lora_A.weight"] = a
        tensors[f"base_model.model.{module_key}.lora_B.weight"] = b
    return tensors, sorted({_suffix(k) for k in adapters})


def _adapters(model, names) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{Hugging Face module key: (lora_A (r, in), lora_B (out, r))}`` of every adapter."""
    out = {}
    for path, module, wname, adapter in lora.adapted(model):
        kernel = getattr(module, wname).get_value()
        param = names.namer(model.config)(tuple((path.split(".") if path else []) + [wname]), tuple(kernel.shape))
        a, b = np.asarray(jax.device_get(adapter.a[...])), np.asarray(jax.device_get(adapter.b[...]))
        lead = a.ndim - adapter.n_in - 1
        if (param.depth if param.stacked else 0) != lead:
            raise ConfigError(f"{path}.{wname}: adapters over {lead} leading axes, but its Hugging Face name has {param.depth}")
        for i, key in enumerate(param.keys):
            at = tuple(int(j) for j in np.unravel_index(i, a.shape[:lead])) if lead else ()
            a_i, b_i = a[at], b[at]  # (in..., r), (r, out...)
            r = a_i.shape[-1]
            out[names.hf_prefix + key.removesuffix(".weight")] = (np.ascontiguousarray(a_i.reshape(-1, r).T),
                                                                  np.ascontiguousarray(b_i.reshape(r, -1).T))  # fmt: skip
    return out


def peft_adapter(model, names, rank: int, alpha: float) -> PeftAdapter:
    """The adapters of ``model`` (rank ``rank``, ``alpha``) as PEFT loads them onto the model
    transformers 5 builds.

    A model without routed experts: one LoRA module per adapted weight (``target_modules``).
    A mixture: transformers 5 holds each layer's experts as two parameters, ``gate_up_proj``
    ``(E, 2I, H)`` (gate and up concatenated) and ``down_proj`` ``(E, H, I)``, which PEFT
    adapts as parameters (``target_parameters``): ``lora_A`` ``(r*E, in)``, row ``e*r + k``,
    and ``lora_B`` ``(out, r*E)``, column ``k*E + e``. gate's and up's adapters become one of
    rank ``2r``: ``A`` the two stacked, ``B`` block-diagonal, so ``B A`` is the two updates
    exactly; ``rank_pattern`` and ``alpha_pattern`` keep ``alpha/r``. When it loads onto a
    mixture, PEFT renames every ``gate_proj``/``up_proj``/``down_proj`` (``w1``/``w3``/``w2``)
    target module to those parameters, the dense layers' and the shared experts' too, so in a
    mixture those are written as parameters (``mlp.gate_proj.weight``). Mixtral's
    ``block_sparse_moe`` is transformers 5's ``mlp``.
    """
    if not getattr(model, "routed", False):
        tensors, modules = peft_tensors(model, names)
        return PeftAdapter(tensors, modules)
    adapters = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in _adapters(model, names).items()}
    out = PeftAdapter({}, [])
    experts: dict[str, dict[str, dict[int, tuple]]] = {}
    modules, params = set(), set()
    for key, (a, b) in adapters.items():
        m = _EXPERT.match(key)
        if m:
            experts.setdefault(m["experts"], {}).setdefault(_ROLE[m["proj"]], {})[int(m["e"])] = (a, b)
            continue
        if _MLP.search(key):
            params.add(_suffix(key) + ".weight")
        else:
            modules.add(_suffix(key))
        out.tensors[f"base_model.model.{key}.lora_A.weight"] = a
        out.tensors[f"base_model.model.{key}.lora_B.weight"] = b
    for where, roles in experts.items():
        gate_up = [role for role in ("gate", "up") if role in roles]
        # PEFT wraps the parameters in target_parameters' order, gate_up_proj first: with
        # down_proj adapted too, gate_up_proj's wrapper is the inner one, its tensors under base_layer.
        for fused, parts, inner in (("gate_up_proj", gate_up, "down" in roles), ("down_proj", ["down"] * ("down" in roles), False)):
            if not parts:
                continue
            a, b = _experts_fused([roles[p] for p in parts], 2 if fused == "gate_up_proj" else 1,
                                  [("gate", "up").index(p) for p in parts] if fused == "gate_up_proj" else [0])  # fmt: skip
            prefix = f"base_model.model.{where}." + ("base_layer." if inner else "")
            out.tensors[prefix + "lora_A.weight"], out.tensors[prefix + "lora_B.weight"] = a, b
            params.add(f"{_suffix(where)}.{fused}")
        if len(gate_up) == 2:
            out.rank_pattern[r".*\.gate_up_proj"] = 2 * rank
            out.alpha_pattern[r".*\.gate_up_proj"] = 2 * alpha
    out.target_modules = sorted(modules)
    out.target_parameters = sorted(params, key=lambda n: (not n.endswith("gate_up_proj"), n))
    return out


def _suffix(key: str) -> str:
    """A module key past its layer number: ``model.layers.3.mlp.gate_proj`` -> ``mlp.gate_proj``."""
    return re.split(r"\.\d+\.", "." + key)[-1].lstrip(".")


def _experts_fused(parts: list[dict], n: int, slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's ``(lora_A (R*E, in), lora_B (n*out, R*E))`` of a parameter holding ``n``
    products per expert side by side (gate_up_proj: ``n`` = 2), from ``parts``: for each
    adapted product ``{expert: (A (r, in), B (out, r))}``, placed at ``slots`` among the
    ``n``. ``R`` = r times the adapted products; expert ``e``'s ``B`` is block-diagonal."""
    E = len(parts[0])
    if any(sorted(p) != list(range(E)) for p in parts):
        raise ConfigError("export --peft: a mixture's expert adapters must cover every expert of the layer")
    r, out_width = parts[0][0][0].shape[0], parts[0][0][1].shape[0]
    R = r * len(parts)
    A = np.zeros((E, R, parts[0][0][0].shape[1]), parts[0][0][0].dtype)
    B = np.zeros((E, n * out_width, R), parts[0][0][1].dtype)
    for j, (part, slot) in enumerate(zip(parts, slots)):
        for e, (a, b) in part.items():
            A[e, j * r : (j + 1) * r] = a
            B[e, slot * out_width : (slot + 1) * out_width, j * r : (j + 1) * r] = b
    # rows e*R + k of A; columns k*E + e of B (PEFT's ParamWrapper.get_delta_factors)
    return np.ascontiguousarray(A.reshape(E * R, -1)), np.ascontiguousarray(B.transpose(1, 2, 0).reshape(n * out_width, R * E))


def _restored(run_dir, warn):
    s, model = restore_model(run_dir, None, warn, sampling_mesh(run_dir, None, note=warn))
    if s.model.lora is None:
        raise ConfigError(f"{run_dir} trained every weight (no --lora-rank): its checkpoints are the whole model; "
                          "nnxscale export writes the adapters of a LoRA run")  # fmt: skip
    if s.model.family is None or s.model.family.lora is None:
        raise ConfigError(f"{run_dir} trained a module of your own: export needs a model family's Hugging Face names")
    return s, model


def export(run_dir, *, peft: Optional[str] = None, merged: Optional[str] = None, warn: Callable[[str], None] = print) -> dict:
    """Write a LoRA run's newest intact checkpoint as a PEFT adapter (``peft``) and/or as its
    base with the adapters folded in (``merged``). Returns ``{"peft": n tensors, "merged": dir}``."""
    if peft is None and merged is None:
        raise ConfigError("nothing to export: give --peft DIR (a PEFT adapter) and/or --merged DIR (a whole model)")

    s, model = _restored(run_dir, warn)
    cfg = TrainConfig.from_dict(saved_config(Path(run_dir)))
    source = cfg.model.init_from or pretrained_source(cfg)
    spec, names = s.model.lora, s.model.family.lora
    out = {}
    if peft is not None:
        adapter = peft_adapter(model, names, spec.rank, spec.alpha)
        tensors = adapter.tensors
        path = Path(peft)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        dropout = spec.dropout
        if adapter.target_parameters and dropout:
            dropout = 0.0  # PEFT's parameter adapters refuse dropout; it changes no logits at inference
            warn(f"{peft}: lora_dropout written as 0 (the run trained with {spec.dropout}): PEFT adapts a mixture's "
                 "MLP weights as parameters, which take no dropout")  # fmt: skip
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": dropout, "target_modules": adapter.target_modules,
            "target_parameters": adapter.target_parameters or None, "bias": "none",
            "fan_in_fan_out": names.fan_in_fan_out, "base_model_name_or_path": source, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None, "use_rslora": False, "use_dora": False,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": adapter.rank_pattern,
            "alpha_pattern": adapter.alpha_pattern,
        }  # fmt: skip
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        out["peft"] = len(tensors)
        out["peft_bytes"] = sum(t.nbytes for t in tensors.values())
    if merged is not None:
        lora.merge_into_base(model)
        s.model.family.save_pretrained(model, merged)
        if source is not None and is_pretrained_dir(source):
            for name in _HF_EXTRAS:
                if (Path(source) / name).is_file():
                    shutil.copyfile(Path(source) / name, Path(merged) / name)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # the run's own, when it kept one
            if (Path(run_dir) / name).is_file() and not (Path(merged) / name).exists():
                shutil.copyfile(Path(run_dir) / name, Path(merged) / name)
        out["merged"] = str(merged)
        out["merged_params"] = sum(math.prod(a.shape) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return out
