"""One chip's figures for the step-time prediction (:mod:`nnxscale.planning.steptime`), for
every chip a target names (:mod:`nnxscale.planning.targets`): peak FLOP/s per compute dtype,
HBM bandwidth, the links a collective can cross, and the few efficiency constants, each with
the public source it comes from. HBM bandwidths and memory are the targets' own data
(:data:`~nnxscale.planning.targets.GPU_CHIPS`); nothing here is fitted to a training run.
A chip's figures are a :class:`Hardware` (its links :class:`Link` s), by chip key in :data:`CHIPS`.

Efficiency constants (the only fitted numbers, each to a published microbenchmark):

- ``matmul_efficiency``: a large bfloat16 GEMM's achieved FLOP/s over the dense peak;
- ``memory_efficiency``: a streaming kernel's achieved bandwidth over the HBM's;
- link ``efficiency``: a large collective's bus bandwidth (nccl-tests ``busbw``) over the
  link's published bandwidth; link ``latency``: a small collective's time;
- ``op_overhead``: seconds each launched op costs beyond its work (a GPU kernel launch).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from nnxscale.planning.targets import GPU_CHIPS
from nnxscale.sharding.devices import CHIP_PEAK_FLOPS


@dataclasses.dataclass(frozen=True)
class Link:
    """One interconnect as a device sees it: ``bandwidth`` bytes/s each device can send on it
    (one direction, as published), ``efficiency`` the fraction a collective reaches (fitted to
    a published collective benchmark), ``latency`` seconds per collective."""

    name: str
    bandwidth: float
    latency: float
    efficiency: float
    sources: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def effective(self) -> float:
        return self.bandwidth * self.efficiency


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One chip's figures for :func:`nnxscale.planning.steptime.predict`.

    ``peak_flops``: dense FLOP/s of its matrix units per compute dtype name (``"bfloat16"``,
    ``"float32"`` as XLA runs a float32 matmul there, ``"float8_e4m3fn"`` where it exists);
    ``hbm_bandwidth`` bytes/s; ``links`` by name (``"nvlink"``, ``"network"``, ``"ici"``,
    ``"dcn"``, ...), the slowest first-class choice for a collective being the one its group
    crosses. Efficiency constants: ``matmul_efficiency`` (a large GEMM's achieved over peak),
    ``memory_efficiency`` (a streaming kernel's achieved over the HBM bandwidth),
    ``op_overhead`` (seconds per op launched), ``kernel_efficiency`` (by custom-call target:
    target name or its prefix: an attention kernel's achieved over peak, where it differs from
    a GEMM's). ``fresh_memory_bandwidth``: bytes/s at which a run's newly mapped buffers are
    first written (page faults), where the runtime maps them anew each run (XLA:CPU); ``None``
    where it keeps them. ``sources``: where each figure is published.
    """

    name: str
    peak_flops: dict
    hbm_bandwidth: float
    links: dict
    matmul_efficiency: float
    memory_efficiency: float
    op_overhead: float
    sources: dict = dataclasses.field(default_factory=dict, compare=False)
    kernel_efficiency: dict = dataclasses.field(default_factory=dict)
    fresh_memory_bandwidth: Optional[float] = None

    @property
    def fp8(self) -> bool:
        """Whether its matrix units multiply FP8 (``--fp8``)."""
        return "float8_e4m3fn" in self.peak_flops

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s at ``dtype`` (a name or an HLO element type); bfloat16's where unknown."""
        name = _DTYPE_NAMES.get(dtype, dtype)
        return self.peak_flops.get(name) or self.peak_flops["bfloat16"]


_DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64", "s8": "int8", "u8": "int8",
                "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}  # fmt: skip

# ---------------------------------------------------------------------------------------
# NVIDIA (SXM boards in HGX/DGX nodes of 8, NVSwitch inside a node, one NIC per GPU across)
# ---------------------------------------------------------------------------------------

_BOOK = "How to Scale Your Model (the JAX scaling book, jax-ml.github.io/scaling-book)"

#: A large bf16 GEMM's achieved over peak: cuBLAS on an 8192^3 bf16 matmul with random inputs
#: ran 257-258 of the A100's 312 TFLOP/s (83%; H. He, "Strangely, Matrix Multiplications on
#: GPUs Run Faster When Given 'Predictable' Data!", thonking.ai, 2024: the GPU is power-limited,
#: as he finds the H100 is too). No comparable published H100 figure was found: taken for
#: every NVIDIA chip.
GPU_MATMUL_EFFICIENCY = 0.82
_AZURE = "Azure/AI-benchmarking-guide, Azure_Results"
#: A streaming kernel's achieved HBM bandwidth over the published one, per chip: the GPU STREAM
#: Copy kernel (one read, one write, as a fusion does) of Microsoft Azure's AI benchmarking
#: guide, each VM's results page, over the datasheet's bandwidth. H100: 2.90 of 3.35 TB/s (ND
#: H100 v5; the page is kept in forks of the repository, e.g. samuel-bohman/AI-benchmarking-guide
#: at 26d18e9); H200: 4.01 of 4.80 (ND H200 v5); A100 80GB: 1.61 of 2.039 (ND A100 v4). No B200
#: figure is published there: the H100's.
_STREAM_COPY = {"h100": 2.90e12, "h200": 4.01e12, "a100": 1.61e12}
GPU_MEMORY_EFFICIENCY = {k: bw / GPU_CHIPS[k]["memory_bandwidth"] for k, bw in _STREAM_COPY.items()}
GPU_MEMORY_EFFICIENCY["b200"] = GPU_MEMORY_EFFICIENCY["h100"]
#: Each chip's results page of that guide (the H100's is kept only in forks).
_AZURE_PAGES = {
    "h100": "ND_H100_v5_results.md (in forks, e.g. samuel-bohman/AI-benchmarking-guide 26d18e9)",
    "h200": "ND_H200_v5_results.md",
    "a100": "ND_A100_v4_results.md (A100-SXM4-80GB)",
}


def _stream_figure(key: str) -> str:
    """The STREAM Copy bandwidth of ``key`` over its datasheet's: "2.90 of 3.35 TB/s"."""
    return f"{_STREAM_COPY[key] / 1e12:.2f} of {GPU_CHIPS[key]['memory_bandwidth'] / 1e12:g} TB/s"


_STREAM_SOURCES = {k: f"{_AZURE}/{_AZURE_PAGES[k]}: GPU STREAM Copy {_stream_figure(k)}" for k in _STREAM_COPY}
_STREAM_SOURCES["b200"] = (f"no published B200 STREAM figure: the H100's {_stream_figure('h100')} "
                           "(Azure's ND H100 v5 results)")  # fmt: skip
#: The GPU-side gap between kernels launched back to back (XLA:GPU launches each fusion and
#: GEMM as a kernel; asynchronous launches overlap the host's cost). An assumption, not fitted.
GPU_OP_OVERHEAD = 2e-6

#: Attention kernels on the GPU, achieved over peak: "FlashAttention-2 ... achieving only 35%
#: utilization on the H100 GPU", FlashAttention-3 "up to 740 TFLOPs/s (75% utilization)" in
#: bf16 (Shah et al., "FlashAttention-3", 2024, abstract). JAX's Pallas GPU flash kernel is a
#: Triton kernel of FlashAttention-2's design: 0.35; cuDNN's fused attention on Hopper uses
#: the warp-specialized design FlashAttention-3 describes: 0.75.
GPU_KERNEL_EFFICIENCY = {"__gpu$xla.gpu.triton": 0.35, "__cudnn$fmha": 0.75}

_GPU_SOURCES = {
    "matmul_efficiency": "H. He, thonking.ai 2024: cuBLAS bf16 8192^3, random inputs, 257-258 of 312 TFLOP/s on A100 "
                         "(83%; Azure's ND A100 v4 results: cuBLASLt fp16 8192^3 253.7, 81%); taken for every NVIDIA chip",
    "op_overhead": "assumption: ~2 us between back-to-back kernels (not a cited fit)",
    "kernel_efficiency": "Shah et al., FlashAttention-3 (2024), abstract: FlashAttention-2 35% of the H100's peak (the "
                         "Pallas GPU kernel, Triton), FlashAttention-3 75% (cuDNN's fused attention)",
}

#: NVLink inside a node: "although NVIDIA claims bandwidths of about 450GB/s over an H100
#: NVLink, it is difficult in practice to exceed 370 GB/s" (the scaling book, "How to Think
#: About GPUs": nccl all-reduce bus bandwidth measured on 8 x H100, SHARP off): 370 / 450.
NVLINK_EFFICIENCY = 370 / 450
#: A small collective's time inside a node: nccl-tests' all-reduce of 1 KiB over 8 GPUs,
#: from its published bus bandwidth (time = 1 KiB x 2(n-1)/n / busbw) on Azure's VMs (the
#: pages above): H100 0.07 GB/s, 26 us; H200 0.06, 30 us; A100 0.04, 45 us. B200: the H100's.
_SMALL_ALLREDUCE_BUSBW = {"h100": 0.07e9, "h200": 0.06e9, "a100": 0.04e9}  # 1 KiB over 8 GPUs
NVLINK_LATENCY = {k: 1024 * 2 * 7 / 8 / busbw for k, busbw in _SMALL_ALLREDUCE_BUSBW.items()}
NVLINK_LATENCY["b200"] = NVLINK_LATENCY["h100"]
_LATENCY_SOURCES = {
    k: f"{_AZURE}/{_AZURE_PAGES[k]}: nccl-tests all-reduce of 1 KiB on 8 x {k.upper()}, bus bandwidth "
       f"{busbw / 1e9:.2f} GB/s: {NVLINK_LATENCY[k] * 1e6:.0f} us"
    for k, busbw in _SMALL_ALLREDUCE_BUSBW.items()
}  # fmt: skip
_LATENCY_SOURCES["b200"] = (f"no published 8 x B200 figure: the H100's {NVLINK_LATENCY['h100'] * 1e6:.0f} us "
                            "(Azure's ND H100 v5 results)")  # fmt: skip
#: InfiniBand across nodes, one 400 Gb/s NIC per GPU (8 per node: 400 GB/s node egress, the
#: scaling book's DGX SuperPod figures). No published bus-bandwidth measurement was found: taken
#: as NVLink's measured efficiency.
NETWORK_EFFICIENCY = NVLINK_EFFICIENCY
NETWORK_LATENCY = 20e-6


def _nvidia(key: str, peaks: dict, nvlink: float, nic: float, sources: dict) -> Hardware:
    chip = GPU_CHIPS[key]
    return Hardware(
        name=chip["name"],
        peak_flops=peaks,
        hbm_bandwidth=chip["memory_bandwidth"],
        links={
            "nvlink": Link("nvlink", nvlink, NVLINK_LATENCY[key], NVLINK_EFFICIENCY, {
                "bandwidth": sources["nvlink"], "latency": _LATENCY_SOURCES[key],
                "efficiency": f"{_BOOK}, 'How to Think About GPUs': all-reduce bus bandwidth on 8 x H100 about 370 of 450 GB/s"}),
            "network": Link("network", nic, NETWORK_LATENCY, NETWORK_EFFICIENCY, {
                "bandwidth": sources["network"], "latency": "assumption: 20 us (not a cited fit)",
                "efficiency": "no published InfiniBand bus-bandwidth figure found: NVLink's measured 370/450"}),
        },
        matmul_efficiency=GPU_MATMUL_EFFICIENCY,
        memory_efficiency=GPU_MEMORY_EFFICIENCY[key],
        op_overhead=GPU_OP_OVERHEAD,
        kernel_efficiency=GPU_KERNEL_EFFICIENCY,
        sources={**_GPU_SOURCES, "memory_efficiency": _STREAM_SOURCES[key], "hbm_bandwidth": "targets.GPU_CHIPS", **sources},
    )  # fmt: skip


_H100_PEAKS = {"bfloat16": CHIP_PEAK_FLOPS["h100"], "float16": CHIP_PEAK_FLOPS["h100"], "float32": 494.7e12, "float8_e4m3fn": 1978.9e12, "float8_e5m2": 1978.9e12, "int8": 1978.9e12}
_HOPPER = {
    "peak_flops": "NVIDIA H100 Tensor Core GPU datasheet, SXM: BF16/FP16 1,979 TFLOPS and FP8 3,958 with sparsity (dense: "
                  "half); TF32 989 with sparsity (494.7 dense; XLA runs float32 matmuls as TF32 by default)",
    "nvlink": "NVLink 4: 900 GB/s per GPU, bidirectional (H100/H200 datasheets): 450 GB/s each way",
    "network": "DGX H100/H200: 8 x ConnectX-7 400 Gb/s, one per GPU: 50 GB/s each way",
}

CHIPS: dict[str, Hardware] = {
    "h100": _nvidia("h100", _H100_PEAKS, 450e9, 50e9, _HOPPER),
    "h200": _nvidia("h200", _H100_PEAKS, 450e9, 50e9, {**_HOPPER, "peak_flops": "NVIDIA H200 datasheet: the H100 SXM's Tensor Core figures"}),
    "a100": _nvidia("a100", {"bfloat16": CHIP_PEAK_FLOPS["a100"], "float16": CHIP_PEAK_FLOPS["a100"], "float32": 156e12, "int8": 624e12}, 300e9, 25e9, {
        "peak_flops": "NVIDIA A100 datasheet: BF16 312 TFLOPS, TF32 156, INT8 624 (dense)",
        "nvlink": "NVLink 3: 600 GB/s per GPU bidirectional (A100 datasheet): 300 GB/s each way",
        "network": "DGX A100: 8 x ConnectX-6 200 Gb/s, one per GPU: 25 GB/s each way",
    }),
    "b200": _nvidia("b200", {"bfloat16": CHIP_PEAK_FLOPS["b200"], "float16": CHIP_PEAK_FLOPS["b200"], "float32": 1100e12, "float8_e4m3fn": 4500e12, "float8_e5m2": 4500e12}, 900e9, 50e9, {
        "peak_flops": "NVIDIA DGX B200 / HGX B200 datasheets: FP8 4.5 PFLOPS, BF16 2.25, TF32 1.1 per GPU dense (half the "
                      "sparse figures)",
        "nvlink": "NVLink 5: 1.8 TB/s per GPU bidirectional: 900 GB/s each way",
        "network": "DGX B200: 8 x ConnectX-7 400 Gb/s, one per GPU: 50 GB/s each way",
    }),
}  # fmt: skip

# ---------------------------------------------------------------------------------------
# Cloud TPU (ICI torus inside a slice, DCN between slices)
# ---------------------------------------------------------------------------------------

#: A large bf16 matmul on a TPU's MXUs, achieved over peak. An assumption (no published TPU
#: matmul microbenchmark was found): the GPUs' measured 0.82 rounded up, since "TPUs can
#: often get closer to peak roofline performance" (the scaling book, "How to Think About GPUs").
TPU_MATMUL_EFFICIENCY = 0.85
TPU_MEMORY_EFFICIENCY = 0.90
#: No launch per op: a TPU program is one executable sequenced by the chip's scalar unit.
TPU_OP_OVERHEAD = 0.0
#: "TPUs achieve peak bandwidth at much lower message sizes" (the scaling book, "How to Think
#: About GPUs", beside its measured v5p all-reduce and v5e all-gather bandwidth): 1.
ICI_EFFICIENCY = 1.0
#: "Each hop over an ICI link has some intrinsic overhead ... typically around 1us" (the
#: scaling book, "Sharded Matrices"): a few hops.
ICI_LATENCY = 5e-6
#: "DCN bandwidth is typically around 2.5e10 bytes / second per host" (the scaling book, "How to
#: Think About TPUs"), shared by the host's chips.
DCN_PER_HOST = 25e9
DCN_EFFICIENCY = NVLINK_EFFICIENCY  # no published DCN collective measurement found: NVLink's measured one
DCN_LATENCY = 50e-6

_SCALING_BOOK = "How to Scale Your Model (the JAX scaling book), part 2 'All About TPUs', its table of TPU specifications"


def _tpu(name: str, bf16: float, int8: float, hbm: float, ici_link: float, chips_per_host: int) -> Hardware:
    dcn_per_chip = DCN_PER_HOST / chips_per_host
    return Hardware(
        name=f"TPU {name}",
        peak_flops={"bfloat16": bf16, "float32": bf16, "int8": int8},
        hbm_bandwidth=hbm,
        links={
            "ici": Link("ici", ici_link, ICI_LATENCY, ICI_EFFICIENCY,
                        {"bandwidth": f"{_SCALING_BOOK}: {ici_link / 1e9:.0f} GB/s one way per ICI link (a ring along a "
                                      "torus dimension with a wraparound uses both directions: twice that)"}),
            "dcn": Link("dcn", dcn_per_chip, DCN_LATENCY, DCN_EFFICIENCY,
                        {"bandwidth": f"{_SCALING_BOOK}: DCN about 25 GB/s per host, {chips_per_host} chips per host: "
                                      f"{dcn_per_chip / 1e9:.2f} GB/s per chip"}),
        },
        matmul_efficiency=TPU_MATMUL_EFFICIENCY,
        memory_efficiency=TPU_MEMORY_EFFICIENCY,
        op_overhead=TPU_OP_OVERHEAD,
        sources={"peak_flops, hbm_bandwidth": _SCALING_BOOK, "float32": "XLA:TPU runs float32 matmuls at DEFAULT precision as bf16 passes"},
    )  # fmt: skip


CHIPS.update({
    "v4": _tpu("v4", CHIP_PEAK_FLOPS["v4"], 275e12, 1.2e12, 45e9, 4),
    "v5p": _tpu("v5p", CHIP_PEAK_FLOPS["v5p"], 918e12, 2.8e12, 90e9, 4),
    "v5e": _tpu("v5e", CHIP_PEAK_FLOPS["v5e"], 394e12, 8.1e11, 45e9, 8),
    "v6e": _tpu("v6e", CHIP_PEAK_FLOPS["v6e"], 1836e12, 1.6e12, 90e9, 8),
})  # fmt: skip
