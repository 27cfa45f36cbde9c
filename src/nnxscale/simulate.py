"""Deprecated path of :mod:`nnxscale.teaching.simulate` (kept for one release; the same module object)."""

import sys
import warnings

from nnxscale.teaching import simulate as _module

warnings.warn("nnxscale.simulate moved to nnxscale.teaching.simulate", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
