"""Deprecated path of :mod:`nnxscale.layers.pipeline` (kept for one release; the same module object)."""

import sys
import warnings

from nnxscale.layers import pipeline as _module

warnings.warn("nnxscale.pipeline moved to nnxscale.layers.pipeline", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
