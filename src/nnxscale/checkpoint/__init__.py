"""Saving and restoring sharded state with Orbax: checkpoints that survive crashes and move meshes.

``checkpointer`` saves a state pytree asynchronously, each process writing its own shards,
and restores it onto any mesh or process count; ``integrity`` checksums every array
without collectives so a damaged checkpoint is found (and set aside) instead of trained
on; ``runlock`` keeps one trainer per run directory.

Loads lazily, on first use of a name: the CLI reads parts of the tree before jax may be imported.
"""

import importlib

_EXPORTS = {
    "Checkpointer": "nnxscale.checkpoint.checkpointer",
    "checkpoint_dir": "nnxscale.checkpoint.checkpointer",
    "RunLock": "nnxscale.checkpoint.runlock",
    "CheckpointError": "nnxscale.errors",
    "DamagedCheckpointError": "nnxscale.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module == f"{__name__}.{name}":
        return importlib.import_module(module)
    return getattr(importlib.import_module(module), name)


def __dir__():
    return __all__
