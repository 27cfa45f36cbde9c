"""Every name nnxscale takes from JAX's private ``jax._src``, one function each.

JAX promises nothing about ``jax._src``: a release may move or drop any of these. So they
are reached here and nowhere else, each through :func:`_private`, which turns a name that
is gone into one :class:`~nnxscale.errors.JaxVersionError` naming it, the running jax and
what nnxscale used it for (the CLI prints that as one line). ``tests/test_jax_private.py``
calls each of them, so a JAX release that drops one fails there first, by name.

Checked present in jax 0.10.2 (Python 3.11's newest), 0.12.0.1 and 0.12.1 (3.12's and 3.13's).
"""

from __future__ import annotations

import functools
import importlib

from nnxscale.errors import JaxVersionError


def _private(module: str, *attributes: str, used_for: str):
    """``jax._src.<module>.<attributes...>``, or a :class:`JaxVersionError` saying it is gone."""
    import jax  # jax: not while the CLI starts

    name = ".".join(["jax._src", module, *attributes])
    try:
        value = importlib.import_module(f"jax._src.{module}")
        for attribute in attributes:
            value = getattr(value, attribute)
    except (ImportError, AttributeError):
        raise JaxVersionError(
            f"jax {jax.__version__} has no {name}, which nnxscale uses {used_for}: install a jax that "
            f"nnxscale supports (pyproject's range) or report it"
        ) from None
    return value


def reset_compilation_cache() -> None:
    """Make JAX ask again whether its persistent compilation cache is on (it remembers)."""
    _private("compilation_cache", "reset_cache", used_for="to turn the compilation cache off and on")()


def cluster_types() -> list:
    """The cluster environments ``jax.distributed.initialize`` can detect (SLURM, Open MPI, ...)."""
    return list(_private("clusters", "ClusterEnv", "_cluster_types", used_for="to detect a cluster as JAX does"))


def distributed_client():
    """The coordination-service client of ``jax.distributed.initialize``, or ``None`` before it."""
    return _private("distributed", "global_state", used_for="to reach the job's coordination service").client


def backends_are_initialized() -> bool:
    """Whether a JAX backend has started in this process (asking ``jax.devices()`` would start one)."""
    return _private("xla_bridge", "backends_are_initialized", used_for="to see whether jax has started")()


def hlo_cost_analysis(module) -> dict:
    """XLA's HLO cost analysis (``flops``, ``bytes accessed``, ...) of an optimized ``HloModule``
    (``compiled.runtime_executable().hlo_modules()``), run by this machine's CPU client: the
    count of a program compiled for a GPU that is not here, whose ``cost_analysis()`` is None."""
    import jax  # jax: not while the CLI starts

    analyse = _private("lib", "_jax", "hlo_module_cost_analysis", used_for="to count the FLOPs of a program compiled for a GPU")
    return dict(analyse(jax.devices("cpu")[0].client, module))


@functools.cache
def cudnn_version():
    """The cuDNN library's version as JAX's fused attention reads it (e.g. 92800), or ``None``
    where none loads (no ``nvidia-cudnn-cu13``, or ``-cu12`` with CUDA 12's plugin: then ``implementation="cudnn"`` cannot even be
    traced, on a GPU or for one)."""
    check = _private("cudnn.fused_attention_stablehlo", "check_cudnn_version", used_for="to see whether cuDNN loads")
    try:
        return check()
    except RuntimeError:  # "cuDNN not found." / "cuDNN is not detected."
        return None
    except SystemError:  # CUDA 13's plugin (0.12.1) without the library: its error untranslated
        return None
