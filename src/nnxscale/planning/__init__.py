"""What a run needs per device, before anything is allocated.

``planner`` compiles the real training step ahead of time for a mesh (abstract arrays
only) and reads the compiler's memory analysis and the collectives in its HLO
(``hlo``); ``sweep`` does it for several meshes. The trainer and the planner build the
run with the same function, :func:`nnxscale.training.setup`.

Loads lazily, on first use of a name: the CLI reads parts of the tree before jax may be imported.
"""

from nnxscale import _lazy

_EXPORTS = {
    "collective_bytes": "nnxscale.planning.hlo",
    "StepPlan": "nnxscale.planning.planner",
    "plan": "nnxscale.planning.planner",
    "sweep": "nnxscale.planning.planner",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
