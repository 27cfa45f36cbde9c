"""nnxscale: plan, create, train, save and restore Flax NNX models in their sharded layout.

The public API is re-exported here and loaded lazily, so that ``import nnxscale`` does not
import jax: the CLI must set the number of simulated CPU devices before jax starts.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # errors: every user-facing error derives from NnxscaleError
    "NnxscaleError": "nnxscale.errors",
    "MeshError": "nnxscale.errors",
    "LayoutError": "nnxscale.errors",
    "RulesError": "nnxscale.errors",
    "ConfigError": "nnxscale.errors",
    "ModelError": "nnxscale.errors",
    "DataError": "nnxscale.errors",
    "CheckpointError": "nnxscale.errors",
    "JobError": "nnxscale.errors",
    # meshes
    "make_mesh": "nnxscale.mesh",
    "parse_mesh_spec": "nnxscale.mesh",
    # layouts
    "shard_shape": "nnxscale.layout",
    "shard_bytes": "nnxscale.layout",
    "full_bytes": "nnxscale.layout",
    "state_bytes": "nnxscale.layout",
    # logical axis rules
    "logical": "nnxscale.rules",
    "get_rules": "nnxscale.rules",
    "logical_to_spec": "nnxscale.rules",
    "PRESETS": "nnxscale.rules",
    "AxisRules": "nnxscale.rules",
    "MeshRules": "nnxscale.rules",
    "resolve": "nnxscale.rules",
    # activations and stacked layers
    "constrain": "nnxscale.activations",
    "use_rules": "nnxscale.activations",
    "stack_layers": "nnxscale.stack",
    "scan_layers": "nnxscale.stack",
    # pipeline parallelism
    "Pipeline": "nnxscale.pipeline",
    "use_pipeline": "nnxscale.pipeline",
    "pipeline_layers": "nnxscale.pipeline",
    "pipeline_cost": "nnxscale.pipeline",
    "to_stage_order": "nnxscale.pipeline",
    "to_layer_order": "nnxscale.pipeline",
    # state sharding
    "state_specs": "nnxscale.sharding",
    "state_shardings": "nnxscale.sharding",
    "abstract_state": "nnxscale.sharding",
    "place": "nnxscale.sharding",
    "reshard": "nnxscale.sharding",
    "layout_bytes": "nnxscale.sharding",
    "lint": "nnxscale.sharding",
    "sharding_table": "nnxscale.sharding",
    "sharded_init": "nnxscale.sharding",
    "compile_init": "nnxscale.sharding",
    "layouts": "nnxscale.sharding",
    # data
    "load_tokens": "nnxscale.data",
    "train_batches": "nnxscale.data",
    "eval_batches": "nnxscale.data",
    "to_global": "nnxscale.data",
    # checkpoints
    "Checkpointer": "nnxscale.checkpoint",
    "checkpoint_dir": "nnxscale.checkpoint",
    # training
    "TrainConfig": "nnxscale.config",
    "train": "nnxscale.train",
    # shard_map
    "data_parallel_apply": "nnxscale.parallel",
    "ColumnParallelLinear": "nnxscale.parallel",
    "RowParallelLinear": "nnxscale.parallel",
    "TensorParallelMLP": "nnxscale.parallel",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nnxscale' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
