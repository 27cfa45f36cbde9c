"""Seed checkpoints (``nnxscale init``): a preset created in its sharded layout and saved as step 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from flax import nnx

from nnxscale.checkpoint.checkpointer import Checkpointer, checkpoint_dir
from nnxscale.checkpoint.runlock import RunLock
from nnxscale.data import text as text
from nnxscale.errors import storage_error
from nnxscale.sharding.mesh import format_mesh, make_mesh
from nnxscale.sharding.rules import resolve
from nnxscale.sharding.state import layout_bytes, sharded_init
from nnxscale.training.config import ConfigError, ModelSettings, TrainConfig
from nnxscale.training.model import run_model
from nnxscale.training.state import pure_dict


def init_run(model: str, mesh_spec, run_dir, *, rules="auto", seed: int = 0, min_shard_bytes: Optional[int] = None) -> dict:
    """Create the preset ``model`` (of any family) in its sharded layout and save it as a seed checkpoint.

    Returns ``{"num_params", "total_bytes", "per_device_bytes", "mesh", "path"}``. Refuses a
    run directory that already holds checkpoints (nothing saved is overwritten).
    """
    run_dir = Path(run_dir)
    root = checkpoint_dir(run_dir)
    if root.exists() and any(root.iterdir()):
        raise ConfigError(f"{run_dir} already holds checkpoints; choose a new --run-dir")
    m = run_model(TrainConfig(model=ModelSettings(name=model)))
    mesh = make_mesh(mesh_spec)
    resolved = resolve(rules, mesh, min_shard_bytes=min_shard_bytes)
    created = sharded_init(lambda: m.build(nnx.Rngs(seed)), mesh, resolved)
    per_device, total = layout_bytes(created, mesh, resolved)
    params = pure_dict(nnx.state(created))
    del created
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error("creating the run directory", run_dir, e) from None
    with RunLock(run_dir), Checkpointer(root, async_save=False) as ckpt:
        ckpt.save(0, {"params": params}, {"kind": "seed", "model": model, "seed": seed}, force=True)
    return {
        "num_params": m.config.num_params(),
        "total_bytes": total,
        "per_device_bytes": per_device,
        "mesh": format_mesh(mesh.shape),
        "path": str(root),
    }
