"""nnxscale: plan, create, train, save and restore Flax NNX models in their sharded layout.

The public API is what this file names, and nothing else (equinox's layout):

- the names of :data:`_EXPORTS`, each re-exported from the private module that implements
  it (``nnxscale/_*.py``: how the code is split into files is not part of the API);
- the public submodules of :data:`_SUBMODULES`, namespaces used by their qualified names:
  ``nnxscale.models`` (model families: ``nnxscale.models.gpt2``, ``FAMILIES``),
  ``nnxscale.errors``, ``nnxscale.distributed`` (jobs of several processes),
  ``nnxscale.simulate``, ``nnxscale.stack`` and ``nnxscale.cli`` (the command line).

No name is both: ``nnxscale.train`` is the function. Both kinds load lazily, on first use,
so that ``import nnxscale`` does not import jax: the CLI must set the number of simulated
CPU devices before jax starts.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> private module that defines it
_EXPORTS = {
    # errors: every user-facing error derives from NnxscaleError (also in nnxscale.errors)
    "NnxscaleError": "nnxscale.errors",
    "MeshError": "nnxscale.errors",
    "LayoutError": "nnxscale.errors",
    "RulesError": "nnxscale.errors",
    "ConfigError": "nnxscale.errors",
    "ModelError": "nnxscale.errors",
    "DataError": "nnxscale.errors",
    "CheckpointError": "nnxscale.errors",
    "DamagedCheckpointError": "nnxscale._checkpoint",
    "JobError": "nnxscale.errors",
    # meshes
    "make_mesh": "nnxscale._mesh",
    "parse_mesh_spec": "nnxscale._mesh",
    # layouts
    "shard_shape": "nnxscale._layout",
    "shard_bytes": "nnxscale._layout",
    "full_bytes": "nnxscale._layout",
    "state_bytes": "nnxscale._layout",
    "format_bytes": "nnxscale._layout",
    # logical axis rules
    "logical": "nnxscale._rules",
    "get_rules": "nnxscale._rules",
    "logical_to_spec": "nnxscale._rules",
    "PRESETS": "nnxscale._rules",
    "LOGICAL_NAMES": "nnxscale._rules",
    "AxisRules": "nnxscale._rules",
    "MeshRules": "nnxscale._rules",
    "resolve": "nnxscale._rules",
    # activations and stacked layers
    "constrain": "nnxscale._activations",
    "use_rules": "nnxscale._activations",
    "record_activations": "nnxscale._activations",
    "ActivationRecord": "nnxscale._activations",
    "stack_layers": "nnxscale.stack",
    "scan_layers": "nnxscale.stack",
    "REMAT_POLICIES": "nnxscale.stack",
    # pipeline parallelism
    "Pipeline": "nnxscale.pipeline",
    "use_pipeline": "nnxscale.pipeline",
    "pipeline_layers": "nnxscale.pipeline",
    "pipeline_cost": "nnxscale.pipeline",
    "to_stage_order": "nnxscale.pipeline",
    "to_layer_order": "nnxscale.pipeline",
    # state sharding
    "state_specs": "nnxscale._sharding",
    "state_shardings": "nnxscale._sharding",
    "abstract_state": "nnxscale._sharding",
    "place": "nnxscale._sharding",
    "reshard": "nnxscale._sharding",
    "layout_bytes": "nnxscale._sharding",
    "lint": "nnxscale._sharding",
    "sharding_table": "nnxscale._sharding",
    "sharded_init": "nnxscale._sharding",
    "compile_init": "nnxscale._sharding",
    "layouts": "nnxscale._sharding",
    # data and tokenizers
    "load_tokens": "nnxscale._data",
    "train_batches": "nnxscale._data",
    "eval_batches": "nnxscale._data",
    "to_global": "nnxscale._data",
    "batch_rows": "nnxscale._data",
    "TokenData": "nnxscale._data",
    "load_tokenizer": "nnxscale._text",
    "tokenize": "nnxscale._text",
    # checkpoints
    "Checkpointer": "nnxscale._checkpoint",
    "checkpoint_dir": "nnxscale._checkpoint",
    # training
    "TrainConfig": "nnxscale._config",
    "OptimConfig": "nnxscale._config",
    "DataConfig": "nnxscale._config",
    "train": "nnxscale._train",
    "TrainResult": "nnxscale._train",
    "setup": "nnxscale._train",
    "Setup": "nnxscale._train",
    "init_state": "nnxscale._train",
    "make_train_step": "nnxscale._train",
    "read_metrics": "nnxscale._train",
    "init_run": "nnxscale._train",
    # sampling
    "sample": "nnxscale._generate",
    "load_model": "nnxscale._generate",
    # planning: memory per device and collectives per step
    "plan": "nnxscale._plan",
    "sweep": "nnxscale._plan",
    "StepPlan": "nnxscale._plan",
    "collective_bytes": "nnxscale._hlo",
    # shard_map
    "data_parallel_apply": "nnxscale._parallel",
    "ColumnParallelLinear": "nnxscale._parallel",
    "RowParallelLinear": "nnxscale._parallel",
    "TensorParallelMLP": "nnxscale._parallel",
}

# public submodules: namespaces, used by their qualified names
_SUBMODULES = ("models", "errors", "distributed", "simulate", "stack", "pipeline", "cli")

__all__ = sorted(_EXPORTS) + list(_SUBMODULES) + ["__version__"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"nnxscale.{name}")  # the import binds it here too
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nnxscale' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
