"""The mesh axis names nnxscale gives a meaning to, and the one way to read a spec entry.

A mesh may name any axes; these are the ones presets, the trainer and the planner know:

- ``DATA`` and ``BATCH`` split the batch (pure data parallelism);
- ``FSDP`` splits the batch and the parameters, gathered per layer when used;
- ``MODEL`` and ``TENSOR`` split matrices within a layer (tensor parallelism);
- ``STAGE`` holds pipeline stages (:mod:`nnxscale.layers.pipeline`);
- ``CONTEXT`` splits the sequence (``length``) of activations, and the parameters like
  FSDP (ring attention: :mod:`nnxscale.layers.attention`);
- ``EXPERT`` holds a share of a mixture's experts (``expert``: :mod:`nnxscale.layers.moe`)
  and, like ``DATA``, splits the batch.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from nnxscale.errors import LayoutError

DATA = "data"
BATCH = "batch"
FSDP = "fsdp"
MODEL = "model"
TENSOR = "tensor"
STAGE = "stage"
CONTEXT = "context"
EXPERT = "expert"

#: Axes that split the batch (every data-like axis; the expert axis's devices hold
#: different experts and different tokens).
BATCH_AXES = (DATA, BATCH, FSDP, EXPERT)
#: Axes that split matrices within a layer.
TENSOR_PARALLEL_AXES = (MODEL, TENSOR)


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry (or one rule's target) names.

    ``None`` -> ``()``, ``"a"`` -> ``("a",)``, ``("a", "b")`` -> ``("a", "b")``. Raises
    LayoutError for an entry that names something other than axes, and for
    ``PartitionSpec.UNCONSTRAINED``, which has no fixed shard shape.
    """
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, (tuple, list)):
        for a in entry:
            if not isinstance(a, str):
                raise LayoutError(f"PartitionSpec entry {entry!r} contains {a!r}, which is not a mesh axis name")
        return tuple(entry)
    if entry is P.UNCONSTRAINED:
        raise LayoutError("PartitionSpec.UNCONSTRAINED has no fixed shard shape")
    raise LayoutError(f"PartitionSpec entry {entry!r} is not None, a mesh axis name or a tuple of names")
