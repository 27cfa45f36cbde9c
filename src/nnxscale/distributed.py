"""Deprecated path of :mod:`nnxscale.jobs.distributed` (kept for one release; the same module object)."""

import sys
import warnings

from nnxscale.jobs import distributed as _module

warnings.warn("nnxscale.distributed moved to nnxscale.jobs.distributed", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
