"""Meshes of accelerators that are not here (deviceless), for compiling the real train step
with that accelerator's own compiler on a CPU machine: a small stand-in until ``nnxscale plan
--target`` lands (issue 31), then swap :func:`target_mesh` for the planner's.

Needs the target's compiler: ``pip install "jax[tpu]==<jax>"`` (libtpu) for TPUs,
``pip install jax-cuda12-plugin==<jax> jax-cuda12-pjrt==<jax>`` for NVIDIA (and
``nvidia-cudnn-cu12`` for the cuDNN attention), with ``JAX_PLATFORMS=cpu`` set before jax
starts. JAX's own ``tests/deviceless_aot_test.py`` does the same.
"""

from __future__ import annotations

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu's per-machine lock file, deviceless

#: An H100 SXM as XLA's GPU compiler describes one (``GpuTargetConfig`` text proto), from
#: NVIDIA's published figures: 132 SMs, 80 GB of HBM3 at 3.35 TB/s, 50 MB of L2, compute 9.0.
H100 = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448 shared_memory_per_core: 233472 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3350000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 85899345920 cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

#: name -> (platform, topology, chip configuration, memory per chip in bytes)
TARGETS = {
    "h100x8": ("cuda", "1x1x8", None, 80 * 10**9),
    "v5e-8": ("tpu", "v5e:2x4", None, 16 << 30),
    "v5p-8": ("tpu", "v5:2x2x1", "megacore", 95 << 30),  # 4 chips, one device each
}


def target_devices(name: str) -> list:
    """The devices of the target ``name`` (one of :data:`TARGETS`), compiled for, not run on."""
    from jax.experimental import topologies

    platform, topology, chip_config, _ = TARGETS[name]
    if platform == "cuda":
        topo = topologies.get_topology_desc(platform="cuda", target_config=H100, topology=topology)
    else:
        kw = {"chip_config_name": chip_config} if chip_config else {}
        topo = topologies.get_topology_desc(topology_name=topology, platform="tpu", num_slices=1, wrap=(False,) * 3, **kw)
    return list(topo.devices)


def target_mesh(name: str, spec: str):
    """``spec`` (``"fsdp=8"``) laid over the devices of ``name``."""
    from nnxscale.sharding.mesh import make_mesh

    return make_mesh(spec, devices=target_devices(name))
