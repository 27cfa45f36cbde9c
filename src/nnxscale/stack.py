"""Deprecated path of :mod:`nnxscale.layers.stack` (kept for one release; the same module object)."""

import sys
import warnings

from nnxscale.layers import stack as _module

warnings.warn("nnxscale.stack moved to nnxscale.layers.stack", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
