"""Accelerators a plan can be compiled for on any machine: ``nnxscale plan --target NAME``.

A target is a set of chips a person owns, by the name they would type: NVIDIA ``h100x8``,
``h100x64`` (whole nodes of 8 beyond one node), ``h200x8``, ``a100x8``, ``b200x8``; Cloud
TPU ``v4-8``, ``v5p-128``, ``v5e-16``, ``v6e-256`` (v4 and v5p names count TensorCores, two
per chip; v5e and v6e names count chips) and several slices, ``2xv6e-256``. The step is
compiled by that accelerator's own compiler, deviceless
(``jax.experimental.topologies.get_topology_desc``): libtpu (``pip install nnxscale[tpu]``)
or the CUDA plugin (``pip install nnxscale[cuda12]``) with a GPU description built here
from the vendor's published specifications (:data:`GPU_CHIPS`), nothing downloaded.

This module is plain data and arithmetic until :meth:`Target.devices` (which imports jax
and needs ``jax_platforms="cpu"`` set before jax starts its backends, as the child process
of :func:`nnxscale.planning.compiler.compile_for_target` does).
"""

from __future__ import annotations

import dataclasses
import math
import re

from nnxscale.errors import NnxscaleError
from nnxscale.sharding.devices import COMPILER_EXTRAS, MEMORY, installed_extra


class TargetError(NnxscaleError, ValueError):
    """A target name that names no known accelerator, or whose compiler is not installed."""


#: What every CUDA GPU since compute capability 7.0 has (CUDA C++ Programming Guide,
#: "Technical Specifications per Compute Capability": threads per block and per SM, warp
#: size, 48 KiB static shared memory per block, grid limits, 64K 32-bit registers per SM
#: and per block).
_CUDA_COMMON = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 49152,
    "threads_per_core_limit": 2048,
    "block_dim_limit_x": 2147483647,
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
    "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
}

#: NVIDIA GPUs, one SXM board each, as the CUDA plugin's compiler is told about them (a
#: ``GpuTargetConfig``); ``sources`` names where each figure is published. Memory is
#: :data:`nnxscale.sharding.devices.MEMORY`'s (what ``--device`` uses).
GPU_CHIPS: dict[str, dict] = {
    "h100": {
        "name": "NVIDIA H100 80GB HBM3",
        "memory": MEMORY["h100"],
        "compute_capability": (9, 0),
        "core_count": 132,
        "fpus_per_core": 128,
        "shared_memory_per_core": 233472,
        "shared_memory_per_block_optin": 232448,
        "memory_bandwidth": 3_350_000_000_000,
        "l2_cache_size": 50 << 20,
        "clock_rate_ghz": 1.98,
        "nvlink": "NVLink 4, 900 GB/s per GPU",
        "sources": {
            "core_count, fpus_per_core, l2_cache_size": "NVIDIA H100 Tensor Core GPU Architecture whitepaper (H100 SXM5: 132 SMs, 128 FP32 cores per SM, 50 MB L2)",
            "memory_bandwidth, clock_rate_ghz, nvlink": "NVIDIA H100 Tensor Core GPU datasheet (SXM: 3.35 TB/s, NVLink 900 GB/s); 1.98 GHz boost, NVIDIA's H100 SXM5 figure",
            "shared memory, compute_capability": "CUDA C++ Programming Guide, compute capability 9.0: 228 KB shared memory per SM, 227 KB per block",
        },
    },
    "h200": {
        "name": "NVIDIA H200",
        "memory": MEMORY["h200"],
        "compute_capability": (9, 0),
        "core_count": 132,
        "fpus_per_core": 128,
        "shared_memory_per_core": 233472,
        "shared_memory_per_block_optin": 232448,
        "memory_bandwidth": 4_800_000_000_000,
        "l2_cache_size": 50 << 20,
        "clock_rate_ghz": 1.98,
        "nvlink": "NVLink 4, 900 GB/s per GPU",
        "sources": {
            "memory, memory_bandwidth, nvlink": "NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s)",
            "core_count, l2_cache_size, shared memory, clock": "the H100 SXM5's Hopper GH100 (H100 whitepaper; CUDA C++ Programming Guide, compute capability 9.0)",
        },
    },
    "a100": {
        "name": "NVIDIA A100-SXM4-80GB",
        "memory": MEMORY["a100"],
        "compute_capability": (8, 0),
        "core_count": 108,
        "fpus_per_core": 64,
        "shared_memory_per_core": 167936,
        "shared_memory_per_block_optin": 166912,
        "memory_bandwidth": 2_039_000_000_000,
        "l2_cache_size": 40 << 20,
        "clock_rate_ghz": 1.41,
        "nvlink": "NVLink 3, 600 GB/s per GPU",
        "sources": {
            "core_count, fpus_per_core, l2_cache_size, clock_rate_ghz": "NVIDIA A100 Tensor Core GPU Architecture whitepaper (108 SMs, 64 FP32 cores per SM, 40 MB L2, 1410 MHz boost)",
            "memory_bandwidth, nvlink": "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: 2,039 GB/s, NVLink 600 GB/s)",
            "shared memory, compute_capability": "CUDA C++ Programming Guide, compute capability 8.0: 164 KB shared memory per SM, 163 KB per block",
        },
    },
    "b200": {
        "name": "NVIDIA B200",
        "memory": MEMORY["b200"],
        "compute_capability": (10, 0),
        "core_count": 148,
        "fpus_per_core": 128,
        "shared_memory_per_core": 233472,
        "shared_memory_per_block_optin": 232448,
        "memory_bandwidth": 8_000_000_000_000,
        "l2_cache_size": 50 << 20,
        "clock_rate_ghz": 1.98,
        "nvlink": "NVLink 5, 1.8 TB/s per GPU",
        "sources": {
            "memory, memory_bandwidth, nvlink": "NVIDIA DGX B200 datasheet (1,440 GB HBM3e and 64 TB/s for 8 GPUs: 180 GB and 8 TB/s each; NVLink 5 1.8 TB/s)",
            "core_count": "148 SMs (2 dies x 74 enabled), as measured on a B200 by Chips and Cheese; NVIDIA's datasheets give no SM count",
            "shared memory, compute_capability": "CUDA C++ Programming Guide, compute capability 10.0: 228 KB shared memory per SM, 227 KB per block",
            "l2_cache_size, clock_rate_ghz, fpus_per_core": "not published by NVIDIA: the H100's figures, an assumption",
        },
    },
}

#: Devices per NVLink domain: the 8 GPUs of an HGX/DGX node (NVIDIA DGX H100/H200/A100/B200
#: datasheets); nodes talk over InfiniBand.
GPUS_PER_NODE = 8

#: Cloud TPU generations. ``topology``: libtpu's name prefix; ``cores_per_chip``: how the
#: public name counts (v4-8 and v5p-8 are 4 chips); ``dims``: the ICI torus's dimensions.
#: Memory is :data:`nnxscale.sharding.devices.MEMORY`'s. Sources: Cloud TPU documentation,
#: "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e" (Trillium) system architecture pages.
TPU_CHIPS: dict[str, dict] = {
    "v4": {"topology": "v4", "memory": MEMORY["tpu-v4"], "cores_per_chip": 2, "dims": 3,
           "ici": "ICI 3D torus", "source": "Cloud TPU docs, TPU v4: 32 GiB HBM2 per chip, 2 TensorCores (megacore), 3D torus"},
    "v5p": {"topology": "v5", "memory": MEMORY["tpu-v5p"], "cores_per_chip": 2, "dims": 3,
            "ici": "ICI 3D torus", "source": "Cloud TPU docs, TPU v5p: 95 GiB HBM2e per chip, 2 TensorCores (megacore), 3D torus"},
    "v5e": {"topology": "v5e", "memory": MEMORY["tpu-v5e"], "cores_per_chip": 1, "dims": 2,
            "ici": "ICI 2D torus", "source": "Cloud TPU docs, TPU v5e: 16 GiB HBM2 per chip, 1 TensorCore, 2D torus, at most 256 chips a slice"},
    "v6e": {"topology": "v6e", "memory": MEMORY["tpu-v6e"], "cores_per_chip": 1, "dims": 2,
            "ici": "ICI 2D torus", "source": "Cloud TPU docs, TPU v6e: 32 GiB HBM per chip, 1 TensorCore, 2D torus, at most 256 chips a slice"},
}  # fmt: skip

#: Slice shapes (chips) that Cloud TPU offers, by chip count (its topology tables).
TPU_SHAPES = {
    2: {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    3: {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8"},
}

@dataclasses.dataclass(frozen=True)
class Target:
    """A set of accelerators: ``chips`` devices of ``memory`` bytes each, compiled for by
    ``platform``'s compiler over ``topology``. Devices share a ``domain`` (a GPU node's NVLink,
    a TPU slice's ICI) of ``domain_size``; domains talk over ``between`` (InfiniBand, DCN)."""

    name: str
    family: str  # "gpu" or "tpu"
    chip: str  # a key of GPU_CHIPS or TPU_CHIPS
    chips: int
    memory: int
    topology: str
    domain: str
    domain_size: int
    within: str
    between: str
    slices: int = 1

    @property
    def platform(self) -> str:
        return "cuda" if self.family == "gpu" else "tpu"

    @property
    def domains(self) -> int:
        return self.chips // self.domain_size

    @property
    def chip_name(self) -> str:
        return GPU_CHIPS[self.chip]["name"] if self.family == "gpu" else f"TPU {self.chip}"

    @property
    def extra(self) -> str:
        """The pip extra that installs this target's compiler (the one installed, if any)."""
        return installed_extra(self.family) or COMPILER_EXTRAS[self.family][0][0]

    def describe(self) -> str:
        """One line: the chips, their memory, how they are connected."""
        from nnxscale.sharding.layout import format_bytes  # loads jax: plain data until Target.devices

        groups = f"{self.domains} {self.domain}s of {self.domain_size}" if self.domains > 1 else f"one {self.domain}"
        between = f", {self.between} between {self.domain}s" if self.domains > 1 else ""
        return f"{self.chips} x {self.chip_name}, {format_bytes(self.memory)} each; {groups} ({self.within}){between}"

    def check_installed(self) -> None:
        """One :class:`TargetError` line naming the extra when this target's compiler is missing."""
        if installed_extra(self.family) is None:
            what = "the CUDA plugin" if self.family == "gpu" else "libtpu"
            raise TargetError(
                f"--target {self.name} compiles with {what}, which is not installed: pip install 'nnxscale[{self.extra}]'"
            )

    def gpu_target_config(self) -> str:
        """The ``GpuTargetConfig`` text proto the CUDA plugin compiles for (GPU targets)."""
        c = GPU_CHIPS[self.chip]
        info = {**_CUDA_COMMON, **{k: c[k] for k in ("core_count", "fpus_per_core", "shared_memory_per_core",
                                                      "shared_memory_per_block_optin", "memory_bandwidth",
                                                      "l2_cache_size", "clock_rate_ghz")}}  # fmt: skip
        fields = " ".join(f"{k}: {v}" for k, v in info.items())
        major, minor = c["compute_capability"]
        return (
            f"gpu_device_info {{ {fields} device_memory_size: {c['memory']} "
            f"cuda_compute_capability {{ major: {major} minor: {minor} }} }} "
            f'platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 8 patch: 0 }} '
            f'device_description_str: "{c["name"]}"'
        )

    def devices(self) -> list:
        """The target's devices, compile-only (jax must run with ``jax_platforms="cpu"``)."""
        from jax.experimental import topologies  # jax here only: the module docstring says why

        if self.family == "gpu":
            return list(topologies.get_topology_desc(platform="cuda", target_config=self.gpu_target_config(),
                                                     topology=self.topology).devices)  # fmt: skip
        kwargs = {"chip_config_name": "megacore"} if TPU_CHIPS[self.chip]["cores_per_chip"] == 2 else {}
        return list(topologies.get_topology_desc(topology_name=self.topology, platform="tpu", num_slices=self.slices,
                                                 **kwargs).devices)  # fmt: skip


def gpu_target(chip: str, count: int) -> Target:
    if count < 1 or (count > GPUS_PER_NODE and count % GPUS_PER_NODE):
        raise TargetError(f"{chip}x{count}: a GPU target is 1 to {GPUS_PER_NODE} GPUs or whole nodes of {GPUS_PER_NODE} (e.g. {chip}x16, {chip}x64)")
    node = min(count, GPUS_PER_NODE)
    return Target(
        name=f"{chip}x{count}", family="gpu", chip=chip, chips=count, memory=GPU_CHIPS[chip]["memory"],
        topology=f"1x{count // node}x{node}", domain="node", domain_size=node,
        within=GPU_CHIPS[chip]["nvlink"], between="InfiniBand",
    )  # fmt: skip


def tpu_target(chip: str, count: int, slices: int = 1) -> Target:
    spec = TPU_CHIPS[chip]
    per = spec["cores_per_chip"]
    chips = count // per
    shapes = TPU_SHAPES[spec["dims"]]
    if count % per or chips not in shapes:
        known = ", ".join(f"{chip}-{c * per}" for c in shapes)
        raise TargetError(f"{chip}-{count} is no {chip} slice nnxscale knows: choose one of {known}")
    name = f"{chip}-{count}" if slices == 1 else f"{slices}x{chip}-{count}"
    return Target(
        name=name, family="tpu", chip=chip, chips=chips * slices, memory=spec["memory"],
        topology=f"{spec['topology']}:{shapes[chips]}", domain="slice", domain_size=chips,
        within=f"{spec['ici']} {shapes[chips]}", between="DCN", slices=slices,
    )  # fmt: skip


_GPU_NAME = re.compile(r"(?P<chip>[a-z]\d+)x(?P<count>\d+)")
_TPU_NAME = re.compile(r"(?:(?P<slices>\d+)x)?(?P<chip>v\d+[a-z]*)-(?P<count>\d+)")

#: What ``--list-targets`` shows (any GPU count works, and any slice shape in TPU_SHAPES).
LISTED = (
    "h100x8", "h100x16", "h100x64", "h200x8", "a100x8", "b200x8",
    "v4-8", "v4-32", "v5e-8", "v5e-16", "v5e-256", "v5p-8", "v5p-16", "v5p-128", "v5p-1024",
    "v6e-8", "v6e-256", "2xv6e-256",
)  # fmt: skip


def get(name: str) -> Target:
    """The target called ``name``; a :class:`TargetError` listing the names otherwise."""
    key = name.strip().lower()
    m = _TPU_NAME.fullmatch(key)
    if m and m["chip"] in TPU_CHIPS:
        return tpu_target(m["chip"], int(m["count"]), int(m["slices"] or 1))
    m = _GPU_NAME.fullmatch(key)
    if m and m["chip"] in GPU_CHIPS:
        return gpu_target(m["chip"], int(m["count"]))
    raise TargetError(
        f"unknown target {name!r}: give a GPU count ({', '.join(f'{c}x8' for c in GPU_CHIPS)}; whole nodes of 8 beyond "
        f"one) or a TPU slice ({', '.join(f'{c}-8' for c in TPU_CHIPS)}, ..., 2xv6e-256); nnxscale plan --list-targets lists them"
    )


def catalog() -> list[Target]:
    return [get(name) for name in LISTED]


def list_lines() -> list[str]:
    """``nnxscale plan --list-targets``: one line per listed target."""
    from nnxscale.sharding.layout import format_bytes  # loads jax: plain data until Target.devices

    header = f"{'target':<11}{'chips':>6}{'memory/chip':>13}  {'extra':<8}interconnect"
    lines = [header, "-" * len(header)]
    for t in catalog():
        groups = f"{t.domains} {t.domain}s of {t.domain_size}: " if t.domains > 1 else ""
        between = f"; {t.between} between {t.domain}s" if t.domains > 1 else ""
        lines.append(f"{t.name:<11}{t.chips:>6}{format_bytes(t.memory):>13}  {t.extra:<8}{groups}{t.within}{between}")
    lines.append("any GPU count: h100xN (N <= 8, or whole nodes of 8); any slice of the shapes above: v5p-32, v5e-64, 4xv5e-256, ...")
    return lines


# --------------------------------------------------------------------------------------
# the mesh on the target's devices
# --------------------------------------------------------------------------------------


def split_over_domains(sizes: dict[str, int], target: Target) -> dict[str, int]:
    """How many of the target's domains (nodes, slices) each mesh axis spans: outer axes
    first, as ``create_hybrid_device_mesh`` lays them (``{axis: domains}``, 1 = inside one;
    :func:`nnxscale.sharding.mesh.process_split`'s arithmetic, domains for processes)."""
    from nnxscale.sharding.mesh import format_mesh, process_split  # loads jax: plain data until Target.devices

    n = math.prod(sizes.values())
    if n != target.chips:
        raise TargetError(
            f"mesh {format_mesh(sizes)} has {n} devices; {target.name} has {target.chips} chips: give a mesh of "
            f"{target.chips} (e.g. fsdp={target.chips}, or -1 for the rest)"
        )
    return process_split(sizes, target.domains)[0]


def placement_notes(sizes: dict[str, int], target: Target) -> list[str]:
    """Where the mesh's axes lie on ``target``: across its nodes or slices and inside each,
    with a warning where a tensor- or context-parallel axis leaves its node or slice."""
    spans = split_over_domains(sizes, target)
    inside = f"inside each {target.domain} ({target.within})"
    if target.domains == 1:
        return [f"mesh on {target.name}: every axis inside one {target.domain} ({target.within})"]
    across = ", ".join(f"{a} {k}" for a, k in spans.items() if k > 1)
    within = ", ".join(f"{a} {s // spans[a]}" for a, s in sizes.items() if s // spans[a] > 1) or "nothing"
    notes = [f"mesh on {target.name}: across its {target.domains} {target.domain}s ({target.between}): {across}; {inside}: {within}"
             " (the outer factor of an axis that spans both, as create_hybrid_device_mesh lays it)"]  # fmt: skip
    slow = [a for a in ("model", "context") if spans.get(a, 1) > 1]
    if slow:
        notes.append(f"{', '.join(slow)} crosses {target.domain}s: its per-layer collectives go over {target.between}; "
                     f"keep it inside a {target.domain} ({target.domain_size} chips) and let data or fsdp cross")  # fmt: skip
    return notes


def alternative_mesh(sizes: dict[str, int], axes, across: bool, target: "Target | None" = None) -> "tuple[dict[str, int], str] | None":
    """The mesh of the same devices to compare when a step waits on the collectives over
    ``axes`` (``across``: those cross ``target``'s nodes or slices), and why, in a phrase; None
    where there is none to propose (a pipeline's ``stage``, or no axis of size above 1):

    1. across domains, an axis other than ``data`` that spans several: that axis kept inside
       a node (slice) and its outer factor moved to ``data``, outermost (HSDP for ``fsdp``):
       one gradient all-reduce a step crosses the network instead of every layer's collectives;
    2. a per-layer axis (``model``, ``context``, ``expert``): that axis turned into ``fsdp``
       (each layer's weights gathered, behind the compute, instead of its activations moved);
    3. ``fsdp``: ``data`` instead (parameters replicated: no gathers, one all-reduce);
    4. ``data``: ``fsdp`` instead (gradients reduce-scattered layer by layer, behind the backward).

    The devices' count and the other axes stay; whether the mesh runs the batch and fits is
    for the plan of it to say."""
    axes = [a for a in axes if sizes.get(a, 1) > 1]
    if not axes or "stage" in axes:
        return None
    if across and target is not None and target.domains > 1:
        spans = split_over_domains(sizes, target)
        crossing = [a for a in axes if a != "data" and spans.get(a, 1) > 1]
        if crossing:
            a = max(crossing, key=lambda x: spans[x])
            k = spans[a]  # data outermost, across the domains; the axis keeps its inner factor
            out = {"data": sizes.get("data", 1) * k, **{x: s // k if x == a else s for x, s in sizes.items() if x != "data"}}
            return {x: s for x, s in out.items() if s > 1}, f"{a} inside each {target.domain}, data across {target.domain}s"
    per_layer = [a for a in ("model", "context", "expert") if a in axes]
    if per_layer:
        return _fold(sizes, per_layer[0], "fsdp"), f"fsdp instead of {per_layer[0]}"
    if "fsdp" in axes:
        return _fold(sizes, "fsdp", "data"), "data instead of fsdp: parameters replicated"
    if "data" in axes:
        return _fold(sizes, "data", "fsdp"), "fsdp instead of data: gradients reduce-scattered layer by layer"
    return None


def _fold(sizes: dict[str, int], axis: str, into: str) -> dict[str, int]:
    """``sizes`` with ``axis`` folded into ``into`` (multiplied by its size): ``into`` keeps
    its place if the mesh has it, else takes ``axis``'s."""
    if into in sizes:
        return {x: s * sizes[axis] if x == into else s for x, s in sizes.items() if x != axis}
    return {into if x == axis else x: s for x, s in sizes.items()}


def mesh_sizes(spec, target: Target) -> dict[str, int]:
    """``{axis: size}`` of a mesh spec on ``target``: ``-1`` takes the chips left."""
    from nnxscale.sharding.mesh import parse_mesh_spec, resolve_mesh_shape  # loads jax: plain data until Target.devices

    axes = parse_mesh_spec(spec)
    sizes = resolve_mesh_shape(axes, target.chips) if -1 in axes.values() else axes
    split_over_domains(sizes, target)  # one line if the mesh does not match the target
    return sizes


def device_mesh(sizes: dict[str, int], target: Target, devices):
    """A ``Mesh`` of ``sizes`` over the target's ``devices``: inside a domain by its physical
    layout (``create_device_mesh``), across domains by ``create_hybrid_device_mesh``."""
    from jax.experimental import mesh_utils  # loads jax: plain data until Target.devices
    from jax.sharding import AxisType, Mesh  # loads jax: plain data until Target.devices

    spans = split_over_domains(sizes, target)
    shape = tuple(sizes.values())
    if target.domains == 1:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        inner = tuple(s // spans[a] for a, s in sizes.items())
        grid = mesh_utils.create_hybrid_device_mesh(inner, tuple(spans.values()), devices, process_is_granule=target.family == "gpu",
                                                    allow_split_physical_axes=True)  # fmt: skip
    return Mesh(grid, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))  # as make_mesh's


def placement(mesh, target: "Target | None" = None) -> "dict | None":
    """Where each device of ``mesh`` sits, by logical device id (row-major position in the
    mesh: what the compiled program's replica groups name), as
    :class:`nnxscale.planning.steptime.Placement` reads it: the node (GPU: its process) or
    slice (TPU) of each, and on a TPU its coordinates on the slice's torus and which dimensions
    wrap around (v4 and v5p: a dimension of a whole number of 4-chip cube edges, joined by the
    optical switches; v5e and v6e: a dimension of 16; the scaling book, "How to Think About
    TPUs"). ``target``: the devices' :class:`Target` (deviceless); ``None``: real devices, the
    torus read from their coordinates. ``None`` is returned for CPU devices."""
    flat = list(mesh.devices.flat)
    platform = flat[0].platform
    if platform == "cpu":
        return None
    if platform != "tpu":
        return {"inner": "nvlink", "outer": "network", "domains": [d.process_index for d in flat]}
    coords = [list(d.coords) for d in flat]
    if target is not None:
        torus = [int(x) for x in target.topology.split(":")[1].split("x")]
        cube = TPU_CHIPS[target.chip]["dims"] == 3
    else:
        torus = [max(c[k] for c in coords) + 1 for k in range(len(coords[0]))]
        cube = "lite" not in flat[0].device_kind.lower() and "v6" not in flat[0].device_kind.lower()
    wraps = [size % 4 == 0 if cube else size == 16 for size in torus]
    return {
        "inner": "ici", "outer": "dcn", "domains": [getattr(d, "slice_index", None) or 0 for d in flat],
        "coords": [c[: len(torus)] for c in coords], "torus": torus, "wraps": wraps,
    }  # fmt: skip
