"""What a run needs per device, before anything is allocated.

By concern: ``report`` (:class:`StepPlan`, :func:`plan` and its text), ``layout`` (exact
arithmetic on the sharded layout), ``estimate`` (the textbook collectives and the analytical
estimate), ``compiler`` (the real training step compiled ahead of time, its memory analysis
and the collectives in its HLO, counted by ``hlo``), ``steptime`` (:func:`predict`: the step's
time from the compiled program and a chip's figures in ``hardware``), ``meshes``
(:func:`sweep`: several meshes planned) and ``trainer`` (``nnxscale.train``: the trainer handed
the step-time prediction for its first speed line). The trainer and the planner build the run
with the same function, :func:`nnxscale.training.setup`.

Loads lazily, on first use of a name: the CLI reads parts of the tree before jax may be imported.
"""

from nnxscale import _lazy

_EXPORTS = {
    "collective_bytes": "nnxscale.planning.hlo",
    "StepPlan": "nnxscale.planning.report",
    "plan": "nnxscale.planning.report",
    "sweep": "nnxscale.planning.meshes",
    "StepTime": "nnxscale.planning.steptime",
    "predict": "nnxscale.planning.steptime",
    "rank_by_time": "nnxscale.planning.steptime",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
