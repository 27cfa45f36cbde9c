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
"""

from __future__ import annotations

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


def peft_tensors(model, names) -> tuple[dict[str, np.ndarray], list[str]]:
    """``({PEFT key: array}, target module names)`` of every adapter of ``model``, named by the
    family's :class:`~nnxscale.models.LoraNames` ``names``."""
    tensors, targets = {}, set()
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
            module_key = names.hf_prefix + key.removesuffix(".weight")
            r = a_i.shape[-1]
            tensors[f"base_model.model.{module_key}.lora_A.weight"] = np.ascontiguousarray(a_i.reshape(-1, r).T)
            tensors[f"base_model.model.{module_key}.lora_B.weight"] = np.ascontiguousarray(b_i.reshape(r, -1).T)
            targets.add(re.split(r"\.\d+\.", "." + module_key)[-1].lstrip("."))
    return tensors, sorted(targets)


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
        tensors, targets = peft_tensors(model, names)
        path = Path(peft)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": targets, "bias": "none",
            "fan_in_fan_out": names.fan_in_fan_out, "base_model_name_or_path": source, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None, "use_rslora": False, "use_dora": False,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        }  # fmt: skip
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        out["peft"] = len(tensors)
        if any(".experts." in k for k in tensors):
            # Measured with PEFT 0.21.2 on transformers 5.25.0 (DeepSeek-V3): adapters of the
            # attention, dense and shared MLPs load exactly (3e-6), the routed experts' not (9e-2).
            warn(f"{peft}: the routed experts' adapters are named per expert (experts.E.gate_proj); transformers 5 "
                 "holds a mixture's experts fused and PEFT does not apply them exactly there: for exact logits "
                 "use --merged, or train without expert targets")  # fmt: skip
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
