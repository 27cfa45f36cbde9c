"""What nnxscale knows about accelerators: memory per device and peak FLOP/s.

Plain data, no jax import, so the command line can list it before jax starts.
"""

from __future__ import annotations

from typing import Optional

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

#: Dense bf16 peak FLOP/s per device, by substring of ``device.device_kind``.
PEAK_FLOPS: dict[str, float] = {
    "B200": 2250e12,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "TPU v6": 918e12,
    "TPU v5p": 459e12,
    "TPU v5": 197e12,  # v5e ("TPU v5 lite")
    "TPU v4": 275e12,
}


def peak_flops(device) -> Optional[float]:
    """Peak dense bf16 FLOP/s of one device, or ``None`` where unknown (CPU)."""
    kind = getattr(device, "device_kind", "")
    for name, flops in PEAK_FLOPS.items():
        if name in kind:
            return flops
    return None
