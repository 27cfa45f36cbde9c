"""nnxscale: plan, create, train, save and restore Flax NNX models in their sharded layout.

The public API is what this file names, and the public names of its packages:

- the names of :data:`_EXPORTS`, the everyday API, each re-exported from where it lives;
- the packages of :data:`_SUBMODULES`, each with an ``__all__`` and a docstring saying what
  it holds. The tree shows the architecture, bottom to top:

  ``errors`` (every user-facing error), ``jobs`` (several processes: ``jax.distributed``,
  the launcher, the watchdog), ``sharding`` (meshes, axis names, layouts, logical axis
  rules, state shardings, activations), ``data`` (text, tokenizers, token files, sharded
  batches), ``layers`` (stacked and scanned blocks, attention, pipelines), ``models``
  (families: GPT-2, Llama, Mixtral; Hugging Face in and out), ``checkpoint`` (Orbax
  checkpoints, checksums, the run lock), ``training`` (config, setup, step, loop,
  sampling), ``planning`` (memory, collectives and step time per device before anything is
  allocated; ``train`` handed the step-time prediction), ``cli`` (the command line), and
  ``teaching`` (the single-device simulations and shard_map layers, used by no trainer).
  A module imports from its own package and those below it only.

Naming: a module inside a package is that package's implementation; what the package's
``__init__`` names is its API.

No name is both a function and a package: ``nnxscale.train`` is the function,
``nnxscale.training`` the package. Everything loads lazily, on first use, so that ``import
nnxscale`` does not import jax: the CLI must set the number of simulated CPU devices before
jax starts.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
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
    "DamagedCheckpointError": "nnxscale.errors",
    "JobError": "nnxscale.errors",
    "JaxVersionError": "nnxscale.errors",
    "DonatedStateError": "nnxscale.errors",
    # meshes
    "make_mesh": "nnxscale.sharding.mesh",
    "parse_mesh_spec": "nnxscale.sharding.mesh",
    # layouts
    "shard_shape": "nnxscale.sharding.layout",
    "shard_bytes": "nnxscale.sharding.layout",
    "full_bytes": "nnxscale.sharding.layout",
    "state_bytes": "nnxscale.sharding.layout",
    "format_bytes": "nnxscale.sharding.layout",
    # logical axis rules
    "logical": "nnxscale.sharding.rules",
    "get_rules": "nnxscale.sharding.rules",
    "logical_to_spec": "nnxscale.sharding.rules",
    "PRESETS": "nnxscale.sharding.rules",
    "LOGICAL_NAMES": "nnxscale.sharding.rules",
    "AxisRules": "nnxscale.sharding.rules",
    "MeshRules": "nnxscale.sharding.rules",
    "resolve": "nnxscale.sharding.rules",
    # activations and stacked layers
    "constrain": "nnxscale.sharding.activations",
    "use_rules": "nnxscale.sharding.activations",
    "record_activations": "nnxscale.sharding.activations",
    "ActivationRecord": "nnxscale.sharding.activations",
    "stack_layers": "nnxscale.layers.stack",
    "scan_layers": "nnxscale.layers.stack",
    "REMAT_POLICIES": "nnxscale.layers.stack",
    # pipeline parallelism
    "Pipeline": "nnxscale.layers.pipeline",
    "use_pipeline": "nnxscale.layers.pipeline",
    "pipeline_layers": "nnxscale.layers.pipeline",
    "pipeline_cost": "nnxscale.layers.pipeline",
    "to_stage_order": "nnxscale.layers.pipeline",
    "to_layer_order": "nnxscale.layers.pipeline",
    "pipeline_value_and_grad": "nnxscale.layers.one_f_one_b",
    # state sharding
    "state_specs": "nnxscale.sharding.state",
    "state_shardings": "nnxscale.sharding.state",
    "abstract_state": "nnxscale.sharding.state",
    "place": "nnxscale.sharding.state",
    "reshard": "nnxscale.sharding.state",
    "layout_bytes": "nnxscale.sharding.state",
    "lint": "nnxscale.sharding.state",
    "sharding_table": "nnxscale.sharding.state",
    "sharded_init": "nnxscale.sharding.state",
    "compile_init": "nnxscale.sharding.state",
    "layouts": "nnxscale.sharding.state",
    # data and tokenizers
    "load_tokens": "nnxscale.data.tokens",
    "train_batches": "nnxscale.data.tokens",
    "eval_batches": "nnxscale.data.tokens",
    "to_global": "nnxscale.data.tokens",
    "batch_rows": "nnxscale.data.tokens",
    "TokenData": "nnxscale.data.tokens",
    "load_tokenizer": "nnxscale.data.text",
    "tokenize": "nnxscale.data.text",
    # checkpoints
    "Checkpointer": "nnxscale.checkpoint.checkpointer",
    "checkpoint_dir": "nnxscale.checkpoint.checkpointer",
    # training
    "TrainConfig": "nnxscale.training.config",
    "OptimConfig": "nnxscale.training.config",
    "DataConfig": "nnxscale.training.config",
    "ModelSettings": "nnxscale.training.config",
    "ParallelConfig": "nnxscale.training.config",
    "CheckpointConfig": "nnxscale.training.config",
    "LoggingConfig": "nnxscale.training.config",
    "LoraSettings": "nnxscale.training.config",
    "train": "nnxscale.planning.trainer",  # the trainer handed the step-time prediction
    "TrainResult": "nnxscale.training.loop",
    "setup": "nnxscale.training.state",
    "Setup": "nnxscale.training.state",
    "init_state": "nnxscale.training.state",
    "make_train_step": "nnxscale.training.step",
    "read_metrics": "nnxscale.training.rundir",
    "init_run": "nnxscale.training.seed",
    # sampling
    "sample": "nnxscale.training.sampling",
    "load_model": "nnxscale.training.sampling",
    "generate": "nnxscale.models.common.generate",
    "Generator": "nnxscale.models.common.generate",
    "Sampling": "nnxscale.models.common.generate",
    # planning: memory per device and collectives per step
    "plan": "nnxscale.planning.report",
    "sweep": "nnxscale.planning.meshes",
    "StepPlan": "nnxscale.planning.report",
    "collective_bytes": "nnxscale.planning.hlo",
    # shard_map
    "data_parallel_apply": "nnxscale.teaching.shard_map",
    "ColumnParallelLinear": "nnxscale.teaching.shard_map",
    "RowParallelLinear": "nnxscale.teaching.shard_map",
    "TensorParallelMLP": "nnxscale.teaching.shard_map",
}

# public submodules: namespaces, used by their qualified names
_SUBMODULES = ("models", "errors", "progress", "sharding", "layers", "training", "data", "checkpoint", "planning", "jobs", "teaching", "cli")

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


def _lazy(package: str, exports: dict[str, str]):
    """``(__getattr__, __dir__)`` for a package whose names load on first use.

    ``exports`` maps each public name to the module that defines it (a name that is the
    module itself, ``"nnxscale.teaching.simulate"`` for ``simulate``, is that module). Every
    package of nnxscale exports this way, so that reading a jax-free corner of the tree (the
    CLI's flags) does not import jax.
    """

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if module == f"{package}.{name}":
            return importlib.import_module(module)
        return getattr(importlib.import_module(module), name)

    def __dir__():
        return sorted(exports)

    return __getattr__, __dir__
