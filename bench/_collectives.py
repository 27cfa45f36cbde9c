"""The project's collective counter (``src/nnxscale/planning/hlo.py``), loaded by its path so
that a benchmark run in another project's environment (MaxText's) counts with it too.

``NNXSCALE_HLO_COUNTER=/path/to/hlo.py`` loads another copy of it instead (a newer one
being written beside this checkout).
"""

from __future__ import annotations

import importlib.util
import os
import sys

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "nnxscale", "planning", "hlo.py")


def _counter():
    path = os.environ.get("NNXSCALE_HLO_COUNTER", _DEFAULT)
    spec = importlib.util.spec_from_file_location("_bench_hlo_counter", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def ops(hlo: str) -> list[tuple[str, int, int]]:
    """``(kind, bytes per device per execution, executions)`` of every collective of a
    compiled module's text."""
    return [(c.kind, c.bytes, c.executions) for c in _counter().collectives(hlo)]


def matmul_flops(hlo: str) -> float:
    """FLOPs per device of one run in matrix products, each loop body once per trip."""
    return _counter().matmul_flops(hlo)
