"""How often a loop whose turns the data decides is expected to turn, kept in the compiled program.

A ``fori_loop`` to a computed count (the expert tiles in use, :mod:`nnxscale.layers.moe`)
compiles to a ``while`` whose trip count no one can read from the program. The code that
builds it knows what to expect: :func:`expected_trips` keeps that in a name scope, which the
compiled program's metadata carries on the loop, and the step-time prediction
(:mod:`nnxscale.planning.steptime`) reads it back by :data:`EXPECTED_TRIPS_PREFIX`. Without
jax until a scope is made: the planner reads the prefix alone.
"""

from __future__ import annotations

#: The name scope's prefix: ``expected_trips_20`` on a loop expected to turn 20 times.
EXPECTED_TRIPS_PREFIX = "expected_trips_"


def expected_trips(turns: int):
    """A context to trace a loop in whose number of turns the data decides (a ``fori_loop`` to
    a computed count): ``turns``, what the code expects it to run, is kept in the compiled
    program's metadata (a name scope), and :func:`nnxscale.planning.steptime.predict` counts
    the loop so many times. Without it such a loop counts at its most where that can be read,
    else once.

    >>> with expected_trips(20):
    ...     y = jax.lax.fori_loop(0, used, body, init)  # doctest: +SKIP
    """
    import jax  # on use: the planner reads EXPECTED_TRIPS_PREFIX without loading jax

    return jax.named_scope(f"{EXPECTED_TRIPS_PREFIX}{max(int(turns), 0)}")
