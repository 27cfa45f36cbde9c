"""Jobs of several processes through JAX's own multi-controller runtime, and keeping them honest.

``distributed`` joins a job (``jax.distributed``: flags, environment or a detected
cluster), watches its peers through the coordination service so a dead process ends the
job fast, and votes on stopping; ``launch`` starts the processes of a job on this
machine; ``watchdog`` ends a process that stops making progress, with its stacks;
``process`` says who owns the process (the command, or the program that called nnxscale).
``jax_private`` is the one place nnxscale reaches JAX's private ``jax._src`` names.

Loads lazily, on first use of a name: the CLI reads parts of the tree before jax may be imported.
"""

from nnxscale import _lazy

_EXPORTS = {
    "Job": "nnxscale.jobs.distributed",
    "JobSpec": "nnxscale.jobs.distributed",
    "StopVote": "nnxscale.jobs.distributed",
    "current": "nnxscale.jobs.distributed",
    "join": "nnxscale.jobs.distributed",
    "leave": "nnxscale.jobs.distributed",
    "ProgressWatchdog": "nnxscale.jobs.watchdog",
    "owns_process": "nnxscale.jobs.process",
    "owned_by_command": "nnxscale.jobs.process",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy(__name__, _EXPORTS)
