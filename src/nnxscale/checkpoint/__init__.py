"""Saving and restoring sharded state with Orbax: checkpoints that survive crashes and move meshes.

``checkpointer`` saves a state pytree asynchronously, each process writing its own shards,
and restores it onto any mesh or process count; ``integrity`` checksums every array
without collectives so a damaged checkpoint is found (and set aside) instead of trained
on; ``runlock`` keeps one trainer per run directory.

Loads lazily, on first use of a name: the CLI reads parts of the tree before jax may be imported.
"""

from nnxscale import _lazy

_EXPORTS = {
    "Checkpointer": "nnxscale.checkpoint.checkpointer",
    "checkpoint_dir": "nnxscale.checkpoint.checkpointer",
    "RunLock": "nnxscale.checkpoint.runlock",
    "CheckpointError": "nnxscale.errors",
    "DamagedCheckpointError": "nnxscale.errors",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
