"""A LoRA run's train state: the adapters train, the base is frozen and is not checkpointed.

With ``--lora-rank`` the train state is ``{"params": adapters, "base": frozen weights,
"opt_state": AdamW over the adapters only, "step", "key"}``: the step differentiates the
adapters alone (the base has no gradient and no optimizer state), and a checkpoint holds
everything but ``"base"`` plus the name of the base it belongs to (:func:`base_record`): a
resume loads that base again from where it came from and refuses another in one line.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscale.checkpoint.checkpointer import checkpoint_dir
from nnxscale.errors import ConfigError
from nnxscale.layers.lora import PREFIX, merge_params
from nnxscale.layers.quantize import is_quantized, quantize_params
from nnxscale.models import is_pretrained_dir
from nnxscale.sharding.layout import format_bytes, full_bytes
from nnxscale.sharding.state import sharded_init

#: The train state's key of the frozen base weights (a LoRA run only); never checkpointed.
BASE = "base"


def _is_adapter_key(key) -> bool:
    return str(key).startswith(PREFIX)


def split_params(tree: dict) -> tuple[dict, dict]:
    """A model's parameters (nested dict) -> ``(adapters, base)``, each a nested dict of the
    same kind (empty branches dropped)."""

    def walk(node, inside: bool):
        if not isinstance(node, dict):
            return (node, None) if inside else (None, node)
        adapters, base = {}, {}
        for k, v in node.items():
            a, b = walk(v, inside or _is_adapter_key(k))
            if a is not None and not (isinstance(a, dict) and not a):
                adapters[k] = a
            if b is not None and not (isinstance(b, dict) and not b):
                base[k] = b
        return adapters, base

    return walk(tree, False)


def model_params(state: dict) -> dict:
    """The parameters of the model a train state describes (the base and its adapters)."""
    return state["params"] if BASE not in state else merge_params(state[BASE], state["params"])


def without_base(tree: dict) -> dict:
    """A train state (or its abstract, or shardings) without the frozen base: what a checkpoint holds."""
    return {k: v for k, v in tree.items() if k != BASE}


def init_adapters(s) -> dict:
    """Fresh adapters of a run (``A`` drawn, ``B`` zero) in their layout: the model's init,
    compiled keeping the adapters only (XLA drops the base's random weights it would draw)."""
    shardings = jax.tree.map(lambda a: a.sharding, s.abstract["params"])

    def create():
        return split_params(nnx.to_pure_dict(nnx.state(s.factory())))[0]

    with jax.set_mesh(s.mesh):
        return jax.jit(create, out_shardings=shardings)()


def _digest(path: Path) -> str:
    """A fingerprint of a Hugging Face directory's weights without reading them all:
    ``config.json`` and, per safetensors file, its name, size, header and last MiB."""
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(size - (1 << 20), 0))
            h.update(fh.read())
    return h.hexdigest()[:16]


def base_record(cfg, source: Optional[str], model) -> dict:
    """What names a LoRA run's base, for its checkpoints: ``{"source", "fingerprint"}``.

    ``source``: the Hugging Face directory or run directory the base came from (fingerprinted
    by its weight files' names, sizes and edges), or ``None``: the preset's weights drawn from
    ``--seed`` (fingerprinted by the architecture and the seed)."""
    if source is None:
        arch = json.dumps({"model": model.describe() if model.family else model.name, "seed": cfg.seed}, sort_keys=True)
        return {"source": f"{cfg.model.name} (seed {cfg.seed})", "fingerprint": hashlib.sha256(arch.encode()).hexdigest()[:16]}
    path = Path(source)
    if is_pretrained_dir(path):
        return {"source": str(path), "fingerprint": _digest(path)}
    steps = sorted(p.name for p in checkpoint_dir(path).iterdir()) if checkpoint_dir(path).is_dir() else []
    return {"source": str(path), "fingerprint": hashlib.sha256(json.dumps(steps).encode()).hexdigest()[:16]}


def check_base(saved: Optional[dict], current: dict, where: str) -> None:
    """Refuse, in one line, adapters saved over another base than this run's."""
    if saved is None or saved.get("fingerprint") == current["fingerprint"]:
        return
    raise ConfigError(
        f"{where} holds LoRA adapters of the base {saved.get('source')} (fingerprint {saved.get('fingerprint')}), but this "
        f"command's base is {current['source']} (fingerprint {current['fingerprint']}): resume over the base they were "
        "trained on (its --model / --init-from), or start a new --run-dir"
    )


def load_base(s, source: Optional[str], load: Callable[[str], dict], log: Optional[Callable[[str], None]] = None) -> dict:
    """The frozen base in its layout: ``load(source)`` (a Hugging Face or run directory), or,
    with no source, the preset's weights drawn from the run's seed (the adapters drawn with
    them are dropped). A ``--quantize-base`` run's base is quantized (``log``: its error)."""
    if source is not None:
        base = load(source)
    else:
        params = nnx.to_pure_dict(nnx.state(sharded_init(s.factory, s.mesh, s.rules, abstract=(s.graphdef, s.model_state))))
        base = split_params(params)[1]
    return base if s.quantized is None else quantize_params(base, *s.quantized, log=log)


def describe(s) -> str:
    """One line: what the adapters adapt and what trains of the model."""
    spec = s.model.lora
    adapters = jax.tree.leaves(s.abstract["params"])
    base = jax.tree.leaves(s.abstract[BASE], is_leaf=is_quantized)
    trainable, frozen = (sum(math.prod(a.shape) for a in t) for t in (adapters, base))
    kinds = sorted({str(jnp.dtype(a.dtype)) for a in base})
    return (
        f"LoRA: rank {spec.rank}, alpha {spec.alpha:g} (scale {spec.scale:g}), dropout {spec.dropout:g}, "
        f"{len(adapters) // 2} adapted weights; {trainable:,} trainable parameters "
        f"({format_bytes(4 * trainable)}), {trainable / max(trainable + frozen, 1):.2%} of {trainable + frozen:,}; "
        f"the base frozen in {'/'.join(kinds)}{_stored(s, base)}"
    )


def _stored(s, base: list) -> str:
    """What ``--quantize-base`` stores of the base: its weights quantized, their bytes."""
    if s.quantized is None:
        return ""
    quantized = [a for a in base if is_quantized(a)]
    size = sum(full_bytes(x.shape, x.dtype) for a in quantized for x in (a.codes, a.scales))
    return f", its {len(quantized)} stacked linear weights stored {s.quantized[1]} ({format_bytes(int(size))} with their scales)"
