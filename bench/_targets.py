"""Meshes of accelerators that are not here (deviceless), for compiling the real train step
with that accelerator's own compiler on a CPU machine, through the planner's catalog
(:mod:`nnxscale.planning.targets`, the same devices as ``nnxscale plan --target``).

Needs the target's compiler: ``pip install 'nnxscale[tpu]'`` (libtpu) for TPUs,
``pip install 'nnxscale[cuda12]'`` for NVIDIA (and ``nvidia-cudnn-cu12`` for the cuDNN
attention), with ``JAX_PLATFORMS=cpu`` set before jax starts.
"""

from __future__ import annotations

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu's per-machine lock file, deviceless

#: The targets these benchmarks compile for (any name of ``nnxscale plan --list-targets`` works).
TARGETS = ("h100x8", "v5e-8", "v5p-8")


def target_devices(name: str) -> list:
    """The devices of the target ``name``, compiled for, not run on."""
    from nnxscale.planning import targets

    return targets.get(name).devices()


def target_mesh(name: str, spec: str):
    """``spec`` (``"fsdp=8"``) laid over the devices of ``name``, as ``plan --target`` lays it."""
    from nnxscale.planning import targets

    target = targets.get(name)
    return targets.device_mesh(targets.mesh_sizes(spec, target), target, target.devices())
