"""Teaching code: the patterns of sharded training shown small, used by no model or trainer.

``simulate`` holds the four single-device simulations (data parallel, FSDP, tensor
parallel, pipeline) with their exact signatures; ``shard_map`` holds data-parallel apply
and column/row tensor-parallel layers written with ``jax.shard_map`` and explicit
collectives, each equal to the unsharded computation. The trainer's tensor parallelism is
not this: it comes from the logical axis rules (:mod:`nnxscale.sharding`) and the compiler.

Loads lazily, on first use of a name: the CLI reads parts of the tree before jax may be imported.
"""

from nnxscale import _lazy

_EXPORTS = {
    "ColumnParallelLinear": "nnxscale.teaching.shard_map",
    "RowParallelLinear": "nnxscale.teaching.shard_map",
    "TensorParallelMLP": "nnxscale.teaching.shard_map",
    "data_parallel_apply": "nnxscale.teaching.shard_map",
    "simulate": "nnxscale.teaching.simulate",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
