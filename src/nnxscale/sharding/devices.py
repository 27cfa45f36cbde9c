"""What nnxscale knows about accelerators: memory per device and peak FLOP/s.

Plain data, no jax import, so the command line can list it before jax starts.
"""

from __future__ import annotations

import importlib.util
import re
from typing import NamedTuple, Optional

GiB = 1 << 30

#: Memory of one device, by the name ``nnxscale plan --device`` takes, in bytes.
MEMORY: dict[str, int] = {
    "h100": 80 * GiB,
    "h200": 141 * GiB,
    "b200": 180 * GiB,
    "a100": 80 * GiB,
    "a100-40gb": 40 * GiB,
    "l4": 24 * GiB,
    "tpu-v4": 32 * GiB,
    "tpu-v5e": 16 * GiB,
    "tpu-v5p": 95 * GiB,
    "tpu-v6e": 32 * GiB,
}

class DeviceKind(NamedTuple):
    """One row of :data:`DEVICE_KINDS`."""

    #: A substring of a JAX device's ``device_kind``.
    substring: str
    #: The chip's key in :data:`nnxscale.planning.hardware.CHIPS` (the step-time prediction's
    #: figures), or ``None`` where it has none.
    chip: Optional[str]
    #: Dense bf16 peak FLOP/s of one device.
    bf16_peak: float


#: What a device is, by substring of its ``device_kind``: the first row whose substring it
#: contains. Order matters: "H200" before "H100", "L40S" and "L40" before "L4", "TPU v5 lite" (v5e) before "TPU v5" (v5p
#: reports itself as "TPU v5"; libtpu's deviceless topologies "v5", "v5e" and "v6e" give
#: "TPU v5", "TPU v5 lite" and "TPU v6 lite", checked with jax 0.10.2 and libtpu 0.0.42.1).
DEVICE_KINDS: tuple[DeviceKind, ...] = (
    DeviceKind("B200", "b200", 2250e12),
    DeviceKind("H200", "h200", 989e12),
    DeviceKind("H100", "h100", 989e12),
    DeviceKind("A100", "a100", 312e12),
    # Ada parts, dense bf16 (the datasheets' sparse figures are twice these): "NVIDIA L40S" and
    # "NVIDIA L40" contain "L4", so they come first.
    DeviceKind("L40S", None, 362e12),
    DeviceKind("L40", None, 181e12),
    DeviceKind("L4", None, 121e12),
    DeviceKind("TPU v6", "v6e", 918e12),  # "TPU v6 lite"
    DeviceKind("TPU v5 lite", "v5e", 197e12),
    DeviceKind("TPU v5e", "v5e", 197e12),
    DeviceKind("TPU v5", "v5p", 459e12),  # "TPU v5", and "TPU v5p" should a libtpu name it so
    DeviceKind("TPU v4", "v4", 275e12),
)

#: Dense bf16 peak FLOP/s per device, by substring of ``device.device_kind`` (:data:`DEVICE_KINDS`'s).
PEAK_FLOPS: dict[str, float] = {k.substring: k.bf16_peak for k in DEVICE_KINDS}

#: Dense bf16 peak FLOP/s per device, by chip key (:data:`DEVICE_KINDS`'s).
CHIP_PEAK_FLOPS: dict[str, float] = {k.chip: k.bf16_peak for k in DEVICE_KINDS if k.chip is not None}


def device_kind(kind: str) -> Optional[DeviceKind]:
    """The row of :data:`DEVICE_KINDS` a ``device_kind`` string matches (the first), or ``None``."""
    return next((k for k in DEVICE_KINDS if k.substring in kind), None)


def peak_flops(device) -> Optional[float]:
    """Peak dense bf16 FLOP/s of one device, or ``None`` where unknown (CPU)."""
    row = device_kind(getattr(device, "device_kind", ""))
    return None if row is None else row.bf16_peak


def memory_of(device) -> Optional[int]:
    """Bytes of memory of one accelerator: what its runtime says where it can (an addressable
    device's ``memory_stats()["bytes_limit"]``), else its kind's (the size in a GPU's name,
    ``"NVIDIA H100 80GB HBM3"``; a chip of :data:`DEVICE_KINDS` by :data:`MEMORY`: a deviceless
    target's devices); ``None`` where unknown (a CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # a deviceless target's devices are not addressable
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    kind = getattr(device, "device_kind", "")
    m = re.search(r"(\d+)\s*GB\b", kind)
    if m and "TPU" not in kind:
        return int(m.group(1)) * GiB
    row = device_kind(kind)
    if row is None or row.chip is None:
        return None
    return MEMORY.get(row.chip, MEMORY.get(f"tpu-{row.chip}"))  # a GPU's chip key is its name; a TPU's is tpu-<chip>


#: The pip extras that install each family's compiler ("gpu": JAX's CUDA plugins, "tpu":
#: libtpu) and the module each brings, the one to name first: JAX ships a CUDA 13 plugin for
#: every release nnxscale supports and a CUDA 12 one only up to 0.12.0.1.
COMPILER_EXTRAS = {"gpu": (("cuda13", "jax_plugins.xla_cuda13"), ("cuda12", "jax_plugins.xla_cuda12")),
                   "tpu": (("tpu", "libtpu"),)}  # fmt: skip


def installed_extra(family: str) -> Optional[str]:
    """The extra whose compiler for ``family`` ("gpu" or "tpu") is installed, or None."""
    for extra, module in COMPILER_EXTRAS[family]:
        try:
            if importlib.util.find_spec(module) is not None:
                return extra
        except ImportError:  # the parent package is missing
            pass
    return None
