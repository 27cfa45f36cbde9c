"""How long a step takes on a chip: a roofline walk over the compiled, scheduled program.

Pure arithmetic over the text of an optimized, scheduled XLA module (``compiled.as_text()``,
``is_scheduled=true``) and one chip's published figures (:class:`Hardware`); no jax
(:func:`expected_trips`, which model code traces with, loads it when a scope is made).

The model, in the order the program runs:

- Every op of the entry computation, in schedule order; a ``while`` body as many times as
  the loop turns (:mod:`nnxscale.planning.hlo` reads the trip counts; a loop to a count the
  data decides, as often as its code expects, :func:`expected_trips`, else at its most),
  nested loops multiplied; a ``call`` as its callee; a ``conditional`` as its slowest branch.
- An op that computes (a fusion, a custom call, a copy, ...): ``max(compute, memory) +
  overhead``. Compute = its matrix products' FLOPs (``dot``/``convolution`` inside it, read
  as :func:`nnxscale.planning.hlo.matmuls` reads them; an attention kernel's from its
  operands' shapes) over the peak at the products' dtype x :attr:`Hardware.matmul_efficiency`;
  elementwise work is not counted. Memory = the bytes it reads and writes (its operands and
  results, not its internals; a slice of a stacked buffer, not the buffer) over the HBM
  bandwidth x :attr:`Hardware.memory_efficiency`. Overhead: :attr:`Hardware.op_overhead`
  (a GPU's kernel launch).
- A collective moves :func:`~nnxscale.planning.hlo.collectives`' bytes over the slowest link
  its replica group crosses: ``factor x bytes / (bandwidth x efficiency) + latency``, factor
  ``(n-1)/n`` for all-gather, reduce-scatter and all-to-all, ``2(n-1)/n`` for all-reduce and
  1 for a permute (ring algorithms; ``n`` the group size).
- Overlap: collectives run on their own stream, one at a time. An asynchronous one (GPU
  ``*-start``/``*-done``, ``async-start``, TPU's async collective fusions) starts where the
  schedule starts it and hides behind the ops scheduled before its ``done``; only what is
  left when the ``done`` is reached is *exposed*. A synchronous collective is all exposed.

- Fresh memory: a runtime that maps a run's buffers anew each time (XLA:CPU: the kernel faults
  in and zeroes every page of the step's temporary buffer and its new outputs, each step)
  spends ``fresh_bytes / Hardware.fresh_memory_bandwidth`` on them; ``None`` where the
  runtime keeps its buffers from one run to the next (GPU and TPU allocators pool them).

Step time = the compute stream's time (compute-bound ops + memory-bound ops + overheads)
+ fresh memory + the exposed collective time. The chips' figures and the few efficiency constants, each
with its published source, are :mod:`nnxscale.planning.hardware`'s.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

from nnxscale.layers.trips import expected_trips  # noqa: F401  (re-exported)
from nnxscale.planning import hardware, hlo, targets
from nnxscale.planning.hardware import Hardware, Link  # noqa: F401  (re-exported: steptime.Hardware, steptime.Link)
from nnxscale.sharding.hlo_text import KINDS, Computation, Instruction, callees, named_computation, read_module

_REGISTERED: dict[str, Hardware] = {}


def register_hardware(platform_key: str, hardware: Hardware) -> None:
    """Make ``hardware`` the figures of ``platform_key`` (a chip key such as ``"h100"``,
    ``"v5p"``, or ``"cpu"`` for this machine's XLA:CPU): :func:`hardware_for` returns it."""
    if not isinstance(hardware, Hardware):
        raise TypeError(f"register_hardware({platform_key!r}, ...) takes a Hardware, got {type(hardware).__name__}")
    _REGISTERED[platform_key] = hardware


def hardware_for(target) -> Hardware:
    """The figures of one chip of ``target``: a :class:`~nnxscale.planning.targets.Target`, its
    name (``"h100x8"``, ``"v5p-128"``), a chip key (``"h100"``, ``"v5e"``) or ``"cpu"``.
    A :class:`KeyError` naming what is known where there are none (``"cpu"`` until registered)."""
    key = target.chip if isinstance(target, targets.Target) else str(target).strip().lower()
    if key in _REGISTERED:
        return _REGISTERED[key]
    if key in hardware.CHIPS:
        return hardware.CHIPS[key]
    if key != "cpu":
        try:
            key = targets.get(key).chip
        except targets.TargetError:
            pass
        else:
            return _REGISTERED.get(key) or hardware.CHIPS[key]
    known = ", ".join(sorted({*hardware.CHIPS, *_REGISTERED}))
    raise KeyError(f"no hardware figures for {target!r}: known are {known}" + ("" if "cpu" in _REGISTERED else
                   "; XLA:CPU's are registered with register_hardware('cpu', ...)"))  # fmt: skip


def axis_links_for(sizes: dict, target) -> dict:
    """``{axis: link name}``: the link each mesh axis of ``sizes`` crosses on ``target``, as
    :func:`nnxscale.planning.targets.split_over_domains` lays it: an axis that spans several
    nodes (slices) crosses the network (DCN), else NVLink (ICI)."""
    spans = targets.split_over_domains(sizes, target)
    inside, between = ("nvlink", "network") if target.family == "gpu" else ("ici", "dcn")
    return {a: between if spans.get(a, 1) > 1 else inside for a in sizes}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each device of a compiled program sits, by logical device id (the position in the
    mesh's devices, row-major: what replica groups name). ``domains``: the node (GPU) or slice
    (TPU) of each; ``inner``/``outer``: the links inside a domain and between domains (names in
    :attr:`Hardware.links`); TPU only: ``coords`` on the slice's ``torus``, which dimensions
    ``wraps`` around (a ring along one uses both directions)."""

    inner: str
    outer: str
    domains: tuple
    coords: tuple = ()
    torus: tuple = ()
    wraps: tuple = ()

    def ways(self, members) -> int:
        """One-way links a ring over ``members`` drives at once: 1 on a switch (NVLink); on a
        torus, 2 per dimension it spans whole with a wraparound, 1 per other dimension it spans."""
        if not self.coords:
            return 1
        cs = [self.coords[d] for d in members]
        total = 0
        for k, size in enumerate(self.torus):
            seen = {c[k] for c in cs}
            if len(seen) > 1:
                total += 2 if self.wraps[k] and len(seen) == size else 1
        return max(total, 1)

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, d: dict) -> "Placement":
        return cls(d["inner"], d["outer"], tuple(d["domains"]), tuple(tuple(c) for c in d.get("coords", ())),
                   tuple(d.get("torus", ())), tuple(d.get("wraps", ())))  # fmt: skip


# --------------------------------------------------------------------------------------
# the prediction
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class CollectiveTime:
    """The collectives of one kind over one link and mesh axes, per device per step:
    ``axes`` the mesh axes their groups span (``"data,fsdp"``; ``""`` where the groups could
    not be placed on the mesh), ``bytes`` as :mod:`nnxscale.planning.hlo` counts them,
    ``count`` executions, ``seconds`` on the link, ``exposed`` of them not hidden behind compute."""

    kind: str
    link: str
    axes: str = ""
    bytes: float = 0.0
    count: int = 0
    seconds: float = 0.0
    exposed: float = 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class StepTime:
    """A step's predicted time on one chip kind, and where it goes (seconds per step).

    ``seconds`` = ``compute_s`` (ops bound by their matrix products) + ``memory_s`` (ops bound
    by HBM traffic) + ``overhead_s`` (op launches) + ``fresh_memory_s`` (first writes of the
    buffers a run maps anew: XLA:CPU's page faults) + ``exposed_collective_s``.
    ``collective_s`` is every collective's time on its link, hidden or not. ``flops``: the
    FLOPs per device the walk counted (kernels' estimated included); ``mfu``: the model's
    FLOPs per step (as the run's metrics count them) over ``n_devices x peak x seconds``.
    """

    hardware: str
    seconds: float
    compute_s: float
    memory_s: float
    overhead_s: float
    collective_s: float
    exposed_collective_s: float
    collectives: list
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: Optional[float]
    bottleneck: str
    flops: float = 0.0
    hbm_bytes: float = 0.0
    ops: int = 0
    kernel_flops: float = 0.0
    notes: list = dataclasses.field(default_factory=list)
    fresh_memory_s: float = 0.0
    fp8_flops: float = 0.0  # of ``flops``: the products whose operands are FP8 (``--fp8``)
    gemm_flops: float = 0.0  # of ``flops``: the GEMMs (dots and cuBLAS calls), not the attention kernels

    @property
    def fp8_share(self) -> float:
        """The share of the step's matrix FLOPs (kernels' included) that run on FP8 operands."""
        return self.fp8_flops / self.flops if self.flops else 0.0

    @property
    def fp8_gemm_share(self) -> float:
        """The share of the step's GEMM FLOPs (its ``dot`` s and cuBLAS calls: every matrix
        product but the attention kernels') that run on FP8 operands."""
        return self.fp8_flops / self.gemm_flops if self.gemm_flops > 0 else 0.0

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["collectives"] = [c.to_json() for c in self.collectives]
        return out


@dataclasses.dataclass
class _Span:
    """What one run of a computation costs (scaled by loop trips when inside a loop)."""

    seconds: float = 0.0
    compute: float = 0.0
    memory: float = 0.0
    overhead: float = 0.0
    flops: float = 0.0
    kernel_flops: float = 0.0
    fp8_flops: float = 0.0
    gemm_flops: float = 0.0
    bytes: float = 0.0
    ops: float = 0.0
    colls: dict = dataclasses.field(default_factory=dict)  # (kind, link, axes) -> CollectiveTime

    def add(self, other: "_Span", times: float = 1.0) -> None:
        for f in ("seconds", "compute", "memory", "overhead", "flops", "kernel_flops", "fp8_flops", "gemm_flops", "bytes", "ops"):
            setattr(self, f, getattr(self, f) + times * getattr(other, f))
        for key, c in other.colls.items():
            mine = self.colls.setdefault(key, CollectiveTime(*key))
            mine.bytes += times * c.bytes
            mine.count += int(round(times * c.count))
            mine.seconds += times * c.seconds
            mine.exposed += times * c.exposed


#: Ops that move nothing and launch nothing: bookkeeping, aliases, views.
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id", "replica-id",
         "opt-barrier", "add-dependency", "copy-start", "copy-done", "domain", "get-dimension-size", "set-dimension-size",
         "async-update", "send-done", "recv-done"}  # fmt: skip
_FREE_CALLS = ("AllocateBuffer", "AssumeGatherIndicesInBound", "GatherScatterIndicesBitpacked", "Sharding", "SPMDFullToShardShape",
               "SPMDShardToFullShape", "MoveToHost", "MoveToDevice")  # fmt: skip
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_FLOATS = {"bf16", "f16", "f32", "f8e4m3fn", "f8e5m2"}
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")


class _Walk:
    """One compiled program walked on one chip's figures: each computation's :class:`_Span`
    (:meth:`span`), built from its ops' times (:meth:`op_time`) and its collectives'
    (:meth:`collective`) as the schedule runs them (:class:`_Streams`)."""

    def __init__(self, hlo_text: str, hw: Hardware, axis_links: Optional[dict], mesh: Optional[dict], n_devices: int,
                 placement: Optional["Placement"] = None):
        self.comps, self.entry, devices = read_module(hlo_text)
        if self.entry is None:
            raise ValueError("no ENTRY computation in this HLO text: pass compiled.as_text()")
        self.devices = devices if devices > 1 else n_devices
        self.hw, self.axis_links, self.mesh, self.placement = hw, dict(axis_links or {}), dict(mesh or {}), placement
        # Across TPU slices each slice runs its own program: its devices are one slice's, laid
        # out as the mesh's inner factors (the outer ones span the slices, create_hybrid_device_mesh's order).
        total = math.prod(self.mesh.values()) if self.mesh else 0
        if total > self.devices > 1 and total % self.devices == 0:
            from nnxscale.sharding.mesh import process_split  # sharding.mesh loads jax: this module is read without it

            spans = process_split(self.mesh, total // self.devices)[0]
            self.mesh = {a: size // spans.get(a, 1) for a, size in self.mesh.items()}
        self.memo: dict[str, _Span] = {}
        self.flops_memo: dict[str, tuple[float, float]] = {}
        self.notes: set = set()

    # ---- one op -------------------------------------------------------------------

    def _type_bytes(self, t) -> float:
        return sum(math.prod(dims) * hlo.DTYPE_BYTES.get(dt, 0) for dt, dims in hlo.leaves(t))

    def _operand_bytes(self, comp: Computation, name: str) -> float:
        instr = comp.instrs.get(name)
        return 0.0 if instr is None else self._type_bytes(instr.type)

    def op_bytes(self, comp: Computation, instr: Instruction) -> float:
        """Bytes an op reads and writes in HBM: its operands and results, where a dynamic
        slice reads its slice and a dynamic-update-slice writes its update in place."""
        op = instr.opcode
        if op == "dynamic-slice":
            return 2 * self._type_bytes(instr.type)
        if op == "dynamic-update-slice" and len(instr.operands) > 1:
            return 2 * self._operand_bytes(comp, instr.operands[1])
        called = callees(instr)
        fused = self.comps.get(called[0]) if op == "fusion" and called else None
        if fused is None:
            return self._type_bytes(instr.type) + sum(self._operand_bytes(comp, o) for o in instr.operands)
        params = {int(i.args): i for i in fused.instrs.values() if i.opcode == "parameter" and i.args.strip().isdigit()}
        users: dict[str, list[Instruction]] = {}
        for i in fused.instrs.values():
            for o in i.operands:
                users.setdefault(o, []).append(i)
        in_place = set()
        written = self._written(fused, fused.root, in_place)
        total = written
        for k, name in enumerate(instr.operands):
            p = params.get(k)
            if p is None:
                total += self._operand_bytes(comp, name)
                continue
            us = self._readers(fused, p.name, users)
            if p.name in in_place and not us:
                continue  # the buffer updated in place: only its update is written
            if us and all(u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == src for u, src in us):
                total += sum(self._type_bytes(u.type) for u, _ in us)
            else:
                total += self._operand_bytes(comp, name)
        return total

    def _readers(self, fused: Computation, name: str, users: dict, depth: int = 0) -> list:
        """``(user, the name it reads)`` of ``name`` through bitcasts; a DUS's target is no reader."""
        out = []
        for u in users.get(name, []):
            if u.opcode == "bitcast" and depth < 8:
                out += self._readers(fused, u.name, users, depth + 1)
            elif u.opcode == "dynamic-update-slice" and u.operands and u.operands[0] == name:
                continue
            else:
                out.append((u, name))
        return out

    def _written(self, fused: Computation, name: str, in_place: set) -> float:
        """Bytes a fusion's result ``name`` writes: a dynamic-update-slice writes its update."""
        i = fused.instrs.get(name)
        if i is None:
            return 0.0
        if i.opcode == "tuple":
            return sum(self._written(fused, o, in_place) for o in i.operands)
        if i.opcode == "bitcast" and i.operands:
            return self._written(fused, i.operands[0], in_place)
        if i.opcode == "dynamic-update-slice" and len(i.operands) > 1:
            target = hlo.underlying(fused, i.operands[0])
            if target is not None and target.opcode == "parameter":
                in_place.add(target.name)
            return self._operand_bytes(fused, i.operands[1])
        return self._type_bytes(i.type)

    def comp_flops(self, name: str, depth: int = 0) -> tuple[float, float, float]:
        """``(FLOPs, seconds at peak x efficiency, FLOPs on FP8 operands)`` of the matrix
        products inside a fused computation."""
        if name in self.flops_memo or depth > 32:
            return self.flops_memo.get(name, (0.0, 0.0, 0.0))
        comp = self.comps.get(name)
        flops = secs = fp8 = 0.0
        for instr in (comp.instrs.values() if comp else ()):
            f, s, f8 = self._direct_flops(comp, instr)
            flops, secs, fp8 = flops + f, secs + s, fp8 + f8
            for callee in callees(instr):
                f, s, f8 = self.comp_flops(callee, depth + 1)
                flops, secs, fp8 = flops + f, secs + s, fp8 + f8
        self.flops_memo[name] = (flops, secs, fp8)
        return flops, secs, fp8

    def kernel_flops(self, instr: Instruction, comp: Computation) -> float:
        """FLOPs of a library call or kernel the HLO does not show: a cuBLAS GEMM from its
        dimension numbers; an attention kernel from its query, key and value shapes."""
        target = _TARGET.search(instr.attrs)
        name = target.group(1) if target else ""
        typed = [hlo.leaves(comp.instrs[o].type)[0] for o in instr.operands if o in comp.instrs and hlo.leaves(comp.instrs[o].type)]
        shapes = [dims for _, dims in typed]
        if name.startswith("__cublas"):
            dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.attrs)
            out = hlo.leaves(instr.type)[0][1] if hlo.leaves(instr.type) else ()
            if dims and shapes and out:
                k = math.prod(shapes[0][int(d.strip('"'))] for d in dims.group(1).split(",") if d.strip())
                return 2.0 * math.prod(out) * k
            return 0.0
        if "fmha" in name or "triton" in name or name == "tpu_custom_call":  # attention kernels (Pallas, cuDNN)
            return _attention_flops(instr, [dims for dt, dims in typed if dt in _FLOATS], self.notes)
        return 0.0

    def op_time(self, comp: Computation, instr: Instruction) -> _Span:
        flops = secs = kflops = fp8 = 0.0
        is_gemm = False  # a cuBLAS call: a GEMM, not an attention kernel
        if instr.opcode in ("dot", "convolution"):
            flops, secs, fp8 = self._direct_flops(comp, instr)
        elif instr.opcode == "custom-call":
            kflops = self.kernel_flops(instr, comp)
            target = _TARGET.search(instr.attrs)
            name = target.group(1) if target else ""
            efficiency = next((e for k, e in self.hw.kernel_efficiency.items() if name.startswith(k)), self.hw.matmul_efficiency)
            dtype = self._lhs_dtype(comp, instr) if name.startswith("__cublas") else "bfloat16"  # an FP8 GEMM at FP8's peak
            secs = kflops / (self.hw.peak(dtype) * efficiency)
            fp8 = kflops if dtype.startswith("f8") else 0.0
            is_gemm = name.startswith("__cublas")
        for callee in callees(instr) if instr.opcode in ("fusion", "custom-call") else ():
            f, s, f8 = self.comp_flops(callee)
            flops, secs, fp8 = flops + f, secs + s, fp8 + f8
        nbytes = self.op_bytes(comp, instr)
        mem = nbytes / (self.hw.hbm_bandwidth * self.hw.memory_efficiency)
        gemm = flops + (kflops if is_gemm else 0.0)
        span = _Span(flops=flops + kflops, kernel_flops=kflops, fp8_flops=fp8, gemm_flops=gemm, bytes=nbytes, ops=1,
                     overhead=self.hw.op_overhead)  # fmt: skip
        if secs >= mem:
            span.compute = secs
        else:
            span.memory = mem
        span.seconds = span.compute + span.memory + span.overhead
        return span

    def _direct_flops(self, comp: Computation, instr: Instruction) -> tuple[float, float, float]:
        """``(FLOPs, seconds, FLOPs on FP8 operands)`` of ``instr`` if it is a matrix product,
        at the peak of its operands' type (FP8 products at the FP8 peak)."""
        m = hlo.as_matmul(comp, instr, self.devices)
        if m is None:
            return 0.0, 0.0, 0.0
        dtype = self._lhs_dtype(comp, instr)
        return m.flops, m.flops / (self.hw.peak(dtype) * self.hw.matmul_efficiency), m.flops if dtype.startswith("f8") else 0.0

    @staticmethod
    def _lhs_dtype(comp: Computation, instr: Instruction) -> str:
        """The HLO element type of an op's first operand ("bf16" where it is not known)."""
        lhs = comp.instrs.get(instr.operands[0]) if instr.operands else None
        leaves = hlo.leaves(lhs.type) if lhs is not None else []
        return leaves[0][0] if leaves else "bf16"

    # ---- collectives --------------------------------------------------------------

    def collective(self, comp: Computation, instr: Instruction) -> Optional[tuple[hlo.Collective, str, str, float]]:
        """``(record, link, axes, seconds)`` of a collective op (or a fusion that is one), else
        None; ``axes``: the mesh axes its groups span, comma-joined (``""``: not placed)."""
        rec = hlo.as_collective(comp, instr, self.devices)
        where = comp, instr
        if rec is None and instr.opcode in ("fusion", "async-start") and callees(instr):
            inner = self.comps.get(callees(instr)[0])
            for i in (inner.instrs.values() if inner else ()):
                rec = hlo.as_collective(inner, i, self.devices)
                if rec is not None:
                    where = inner, i
                    break
        if rec is None:
            return None
        attrs = where[1].attrs
        if instr.opcode == "send":  # across TPU slices: a DCN host transfer (hlo.as_collective)
            link, seconds = self.dcn_seconds(rec)
            return rec, link, ",".join(a for a, lk in self.axis_links.items() if lk == link), seconds
        link, seconds = self.collective_seconds(rec, attrs)
        axes = _spanned_axes(attrs, self.mesh, self.devices) if self.mesh else None
        return rec, link, ",".join(axes or ()), seconds

    def dcn_seconds(self, rec: hlo.Collective) -> tuple[str, float]:
        """``(link, seconds)`` of a collective across TPU slices: over the link between
        domains (DCN), each chip's share at its own bandwidth (a host's DCN shared by its
        chips): ``factor(slices) x bytes / link + latency``."""
        outer = self.placement.outer if self.placement is not None else "dcn"
        lk = self.hw.links.get(outer) or self.hw.links[self._link_names()[-1]]
        return lk.name, _ring_factor(rec.kind, max(rec.group, 1)) * rec.bytes / lk.effective + lk.latency

    def collective_seconds(self, rec: hlo.Collective, attrs: str) -> tuple[str, float]:
        """``(link, seconds)``: a collective's time on the links its group crosses.

        Ring algorithms: ``factor x bytes / bandwidth`` with factor ``(n-1)/n`` for a gather, a
        scatter or an all-to-all, twice that for an all-reduce, 1 for a permute. A group that
        spans ``M`` domains (nodes, slices) with ``g`` devices in each runs hierarchically, as
        NCCL does over a fat tree and XLA over DCN: ``max(factor(g) x bytes / inner, factor(M) x
        bytes / (g x outer))`` (the ``g`` devices of a domain each send their share over their
        own NIC); an all-to-all cannot split that way: ``(M-1)/M x bytes / outer``. On a TPU
        torus a ring uses both directions of each dimension it spans that wraps around, one
        direction of one that does not (the scaling book's rule).
        """
        n = max(rec.group, 1)
        if not rec.bytes:
            return self._link_names()[0], 0.0
        kind = rec.kind
        p = self.placement
        groups = hlo.group_members(attrs, self.devices) if p is not None else None
        if p is None or not groups or max(max(g) for g in groups) >= len(p.domains):
            link = self.link_of(attrs, n)
            lk = self.hw.links[link]
            return link, _ring_factor(kind, n) * rec.bytes / lk.effective + lk.latency
        members = sorted({d for g in groups for d in g}) if kind == "collective-permute" else groups[0]
        domains = {p.domains[d] for d in members}
        m = len(domains)
        g = max(len(members) // m, 1)
        inner, outer = self.hw.links[p.inner], self.hw.links[p.outer]
        ways = p.ways(members)
        if kind == "collective-permute":  # one hop each, one direction: over the slowest link a pair crosses
            lk = outer if any(len({p.domains[d] for d in pair}) > 1 for pair in groups) else inner
            return lk.name, rec.bytes / lk.effective + lk.latency
        t_in = _ring_factor(kind, g) * rec.bytes / (inner.effective * ways) if g > 1 else 0.0
        if m == 1:
            return inner.name, t_in + inner.latency
        t_out = _ring_factor(kind, m) * rec.bytes / (outer.effective * (1 if kind == "all-to-all" else g))
        return outer.name, max(t_in, t_out) + outer.latency

    def _link_names(self) -> list:
        return list(self.hw.links)

    def link_of(self, attrs: str, group: int) -> str:
        """The slowest link a collective's replica group crosses (the mesh axes its members
        differ along, each's link from ``axis_links``)."""
        links = self.hw.links
        if not self.axis_links:
            return next(iter(links))
        distinct = set(self.axis_links.values())
        if len(distinct) == 1:
            return distinct.pop()
        axes = _spanned_axes(attrs, self.mesh, self.devices) if self.mesh else None
        if axes is None:  # cannot tell: the slowest link any axis of this size could cross
            self.notes.add("some collectives' replica groups could not be placed on the mesh: counted on the slowest link")
            chosen = [lk for a, lk in self.axis_links.items() if self.mesh.get(a, group) >= 1]
        else:
            chosen = [self.axis_links.get(a, next(iter(links))) for a in axes] or [next(iter(links))]
        return min(chosen, key=lambda name: links[name].effective if name in links else math.inf)

    # ---- the schedule -------------------------------------------------------------

    def span(self, name: str, depth: int = 0) -> _Span:
        """One run of computation ``name``: its ops in schedule order on the two streams."""
        if name in self.memo:
            return self.memo[name]
        comp = self.comps.get(name)
        if comp is None or depth > 64:
            return _Span()
        streams = _Streams()
        for instr in comp.instrs.values():
            self.schedule(streams, comp, instr, depth)
        out = streams.finish(lambda key: _channel(self, comp.instrs[key]))
        self.memo[name] = out
        return out

    def schedule(self, s: "_Streams", comp: Computation, instr: Instruction, depth: int) -> None:
        """Put one op of ``comp`` on the streams: what it runs on the compute stream, a
        collective on the collective stream, a ``done`` as a wait for its collective."""
        op = instr.opcode
        if op == "recv-done" and instr.operands and (recv := comp.instrs.get(instr.operands[0])) is not None:
            key = s.by_token.get(recv.operands[0] if recv.operands else "", "")
            if key in s.pending:
                s.wait(key)
            return
        if op == "recv" and "_xla_megascale" in instr.attrs:
            return  # the receiving half of a DCN transfer: priced at its send
        if op in _FREE or (op == "custom-call" and (m := _TARGET.search(instr.attrs)) and m.group(1) in _FREE_CALLS):
            return
        if op == "while":
            s.compute(self.loop_span(comp, instr, depth))
        elif op == "conditional":
            branches = [self.span(b, depth + 1) for b in callees(instr)]
            if branches:
                s.compute(max(branches, key=lambda b: b.seconds))
        elif op == "call":
            for callee in callees(instr):
                s.compute(self.span(callee, depth + 1))
        elif op.endswith("-done") or (op == "fusion" and _calls_target(self, instr, "AsyncCollectiveDone")):
            self.await_done(s, comp, instr)
        elif (coll := self.collective(comp, instr)) is not None:
            self.issue_collective(s, instr, coll)
        elif op.endswith("-start") or op == "async-start":  # an async op that is no collective: its computation runs here
            for callee in callees(instr):
                s.compute(self.span(callee, depth + 1))
            if not callees(instr):
                s.compute(self.op_time(comp, instr))
        else:
            s.compute(self.op_time(comp, instr))

    def loop_span(self, comp: Computation, loop: Instruction, depth: int) -> _Span:
        """One run of a ``while``: its body as many times as it turns, its condition once more."""
        trip = self.turns(comp, loop)
        sub = _Span()
        sub.add(self.span(named_computation(loop.attrs, "body") or "", depth + 1), trip)
        sub.add(self.span(named_computation(loop.attrs, "condition") or "", depth + 1), trip + 1)
        return sub

    def turns(self, comp: Computation, loop: Instruction) -> int:
        """How often a ``while`` turns: its trip count where the compiler or the loop says it;
        for a loop to a count the data decides, as often as its code expects
        (:func:`expected_trips`), else at its most; else once. A note says which was guessed."""
        trip, how = hlo.loop_turns(self.comps, comp, loop)
        if how == "expected":
            self.notes.add("a loop runs a data-dependent number of turns (a fori_loop to a computed count): "
                           "counted as the turns its code expects (expected_trips)")  # fmt: skip
        elif how == "bound":
            self.notes.add("a loop runs a data-dependent number of turns (a fori_loop to a computed count): "
                           "counted at its most, the extent of the buffers it fills a slice a turn")  # fmt: skip
        if trip is None:
            self.notes.add("a loop's trip count could not be read: counted once")
            trip = 1
        return trip

    def await_done(self, s: "_Streams", comp: Computation, done: Instruction) -> None:
        """A collective's ``done``: the compute stream waits for the collective it closes, or,
        where that was started at the end of the previous turn of this loop (a pipelined
        collective), marks where this turn waits for it (:meth:`_Streams.finish`)."""
        key = done.operands[0] if done.opcode.endswith("-done") and done.operands else ""
        if key not in s.pending:
            key = s.by_channel.get(_channel(self, done), "")
        if key in s.pending:
            s.wait(key)
        else:
            for k in (_carried_start(comp, done), "channel:" + _channel(self, done)):
                s.early.setdefault(k, s.t)

    def issue_collective(self, s: "_Streams", instr: Instruction, coll: tuple) -> None:
        """Start collective ``instr`` (:meth:`collective`'s ``coll``) on the collective stream:
        an asynchronous one runs on until its ``done``, a synchronous one is waited for here."""
        rec, link, axes, seconds = coll
        op = instr.opcode
        key = s.issue((rec.kind, link, axes), rec.bytes, seconds)
        asynchronous = (op.endswith("-start") or op == "async-start" or op == "send"
                        or _calls_target(self, instr, "AsyncCollectiveStart"))  # fmt: skip
        if op == "send" and len(instr.operands) > 1:
            s.by_token[instr.operands[1]] = instr.name
        if asynchronous:
            s.start(instr.name, key, _channel(self, instr))
        else:
            s.expose(s.net)


class _Streams:
    """One run of a computation on its two streams: the compute stream's clock ``t``; the
    collective stream, which runs one collective at a time and is free from ``net``; the
    collectives started and not yet awaited (``pending``: when each ends, its ``(kind, link,
    axes)``), and the :class:`_Span` they add up to."""

    def __init__(self):
        self.out = _Span()
        self.t = self.net = 0.0
        self.pending: dict[str, tuple[float, tuple]] = {}
        self.by_channel: dict[str, str] = {}  # a started collective's channel id: its name
        self.by_token: dict[str, str] = {}  # a DCN transfer's token: its send (started), awaited at its recv-done
        self.early: dict[str, float] = {}  # a loop body's done of a collective its previous turn started: when it waits
        self.issued: list = []  # (begin, end, (kind, link, axes)) of this computation's collectives, one at a time on their stream

    def compute(self, sub: _Span) -> None:
        """Run ``sub`` on the compute stream."""
        self.out.add(sub)
        self.t += sub.seconds

    def issue(self, key: tuple, nbytes: float, seconds: float) -> tuple:
        """Queue a collective of ``seconds`` on the collective stream, from now or when the one
        before it ends; ``key``: its ``(kind, link, axes)``, returned."""
        c = self.out.colls.setdefault(key, CollectiveTime(*key))
        c.bytes += nbytes
        c.count += 1
        c.seconds += seconds
        begin = max(self.t, self.net)
        self.net = begin + seconds
        self.issued.append((begin, self.net, key))
        return key

    def start(self, name: str, key: tuple, channel: str) -> None:
        """The collective just issued, ``name``, runs on until its ``done`` waits for it."""
        self.pending[name] = (self.net, key)
        if channel:
            self.by_channel[channel] = name

    def expose(self, until: float) -> None:
        """The compute stream waits from ``t`` to ``until``: the collectives running then are exposed."""
        for begin, end, key in self.issued:
            overlap = min(end, until) - max(begin, self.t)
            if overlap > 0:
                self.out.colls[key].exposed += overlap
        self.t = max(self.t, until)

    def wait(self, name: str) -> None:
        """The compute stream waits for pending collective ``name`` to end."""
        end, _ = self.pending.pop(name)
        self.expose(end)

    def finish(self, channel_of) -> _Span:
        """The run's span, once the collectives still pending are settled. One awaited in the
        next turn of its loop (a ``done`` seen before its start: ``early``, by start name or by
        ``channel:`` and its channel id, ``channel_of(name)``) is hidden by the rest of this turn
        and the next one's ops before its ``done``; any other is waited for here."""
        end_of_turn = self.t
        for name in list(self.pending):
            ch = "channel:" + channel_of(name)
            done_at = self.early.get(name, self.early.get(ch)) if ch != "channel:" else self.early.get(name)
            if done_at is None:  # the scheduler closes every pair in its computation; be safe
                self.wait(name)
                continue
            end, key = self.pending.pop(name)
            waits = max(end - end_of_turn - done_at, 0.0)
            self.out.colls[key].exposed += waits
            self.t += waits
        self.out.seconds = self.t
        return self.out


def _carried_start(comp: Computation, done: Instruction) -> str:
    """The start a loop body's ``done`` waits for when that start is the previous turn's: the
    done reads a loop parameter's element that the body's root sets to the start."""
    g = hlo.underlying(comp, done.operands[0]) if done.operands else None
    m = re.search(r"\bindex=(\d+)", g.attrs) if g is not None and g.opcode == "get-tuple-element" else None
    root = comp.instrs.get(comp.root)
    if m is None or root is None or root.opcode != "tuple" or int(m.group(1)) >= len(root.operands):
        return ""
    src = hlo.underlying(comp, root.operands[int(m.group(1))])
    return src.name if src is not None else ""


def _calls_target(walk: _Walk, instr: Instruction, target: str) -> bool:
    if instr.opcode != "fusion":
        return False
    called = callees(instr)
    comp = walk.comps.get(called[0]) if called else None
    return comp is not None and any(i.opcode == "custom-call" and f'custom_call_target="{target}"' in i.attrs for i in comp.instrs.values())


def _channel(walk: _Walk, instr: Instruction) -> str:
    """The channel id of a collective op or of the collective inside a fusion."""
    m = _CHANNEL.search(instr.attrs)
    if m:
        return m.group(1)
    called = callees(instr)
    comp = walk.comps.get(called[0]) if called else None
    for i in comp.instrs.values() if comp else ():
        m = _CHANNEL.search(i.attrs)
        if m and i.opcode.removesuffix("-start") in (*KINDS, "ragged-all-to-all"):
            return m.group(1)
    return ""


def _attention_flops(instr: Instruction, shapes: list, notes: set) -> float:
    """An attention kernel's FLOPs from its floating-point operands (``shapes``; a mask's block
    tables are integers). Its first two rank-3 or rank-4 operands
    are the query and the key: ``(H, T, D)`` per sequence (TPU splash), ``(B, T, H, D)`` or
    ``(B, H, T, D)`` (the key's sequence: its longer middle dimension). Each product over the
    scores is ``2 x (query elements) x S`` FLOPs, halved for a causal mask (nnxscale's models
    are causal decoders). The kernel's name (its instruction or the JAX function in its
    metadata) says which: a forward runs two products (scores, weighted values); a backward
    recomputes the scores and the probabilities' gradient and runs one more per gradient it
    returns (``dq`` 3, ``dkv`` 4, dq, dk and dv fused 5, as FlashAttention-2's); a
    ``preprocess`` kernel (the backward's row sums) none. Unnamed: a forward with three
    activations in, a backward with more."""
    source = hlo.OP_NAME.search(instr.attrs)
    names = f"{instr.name} {source.group(1) if source else ''}".lower()
    if "preprocess" in names:
        return 0.0
    acts = [s for s in shapes if len(s) in (3, 4)]
    if len(acts) < 2:
        if shapes:
            notes.add("a kernel whose FLOPs could not be read from its operands: its matmuls are not counted")
        return 0.0
    q, k = acts[0], acts[1]
    seq = k[-2] if len(k) == 3 else max(k[1], k[2])
    per_product = 2.0 * math.prod(q) * seq / 2  # causal: half the score matrix
    grads = max(len([x for x in hlo.leaves(instr.type) if len(x[1]) in (3, 4)]), 1)
    if "dkv" in names:
        products = 4
    elif re.search(r"(^|[^a-z])dq([^a-z]|$)", names):
        products = 3
    elif "fwd" in names or "forward" in names:
        products = 2
    elif "bwd" in names or "backward" in names:
        products = 2 + min(grads, 3)
    else:
        products = 2 if len(acts) <= 3 else 2 + min(grads, 3)
    return products * per_product


def _ring_factor(kind: str, k: int) -> float:
    """The share of a collective's bytes each of ``k`` devices puts on the wire with ring
    algorithms: ``(k-1)/k`` for a gather, a scatter or an all-to-all, twice that for an
    all-reduce, the whole buffer for a permute or broadcast (none within one device)."""
    if kind == "collective-permute" or kind == "collective-broadcast":
        return 1.0 if k > 1 else 0.0
    share = (k - 1) / k
    return 2 * share if kind == "all-reduce" else share


def _spanned_axes(attrs: str, mesh: dict, devices: int) -> Optional[list[str]]:
    """The axes of ``mesh`` (``{axis: size}`` in its order; device id = row-major position)
    along which a collective's group members differ."""
    groups = hlo.group_members(attrs, devices)
    if not groups or math.prod(mesh.values()) != devices:
        return None
    names, sizes = list(mesh), list(mesh.values())

    def coords(d: int) -> tuple:
        out = []
        for s in reversed(sizes):
            out.append(d % s)
            d //= s
        return tuple(reversed(out))

    varying = set()
    for g in groups if "source_target_pairs" in attrs else groups[:1]:
        cs = [coords(d) for d in g]
        varying |= {names[k] for k in range(len(names)) if len({c[k] for c in cs}) > 1}
    return [a for a in names if a in varying]


def predict(
    hlo_text: str,
    hw: Hardware,
    *,
    axis_links: Optional[dict] = None,
    n_devices: int,
    tokens_per_step: int,
    model_flops_per_step: float,
    mesh: Optional[dict] = None,
    placement: Optional[Placement] = None,
    compute_dtype: str = "bfloat16",
    fresh_bytes: float = 0.0,
) -> StepTime:
    """The step time of a compiled, scheduled program on ``hw`` (see the module docstring).

    Where collectives go: ``placement`` (:class:`Placement`, read from the target's devices
    by :func:`nnxscale.planning.targets.placement`) places each replica group's members on
    nodes or slices and the torus; without it, ``axis_links`` (``{mesh axis: link name in
    hw.links}``, :func:`axis_links_for`) with ``mesh`` (``{axis: size}`` in the mesh's order)
    gives each collective the slowest link of the axes its group spans; without those, every
    collective goes over the first of ``hw.links``. ``tokens_per_step``: the global batch's
    tokens; ``model_flops_per_step``: all devices' training FLOPs as the run's metrics count
    them (6N + attention per token x tokens), for ``mfu``; ``compute_dtype``: whose peak the
    MFU is over. ``fresh_bytes``: per device, what the step maps anew each run, its temporary
    buffer and the outputs not aliased to inputs (:func:`fresh_bytes_of` a compiled program's
    memory analysis); it costs time only on a ``hw`` with a ``fresh_memory_bandwidth``.
    """
    for axis, link in (axis_links or {}).items():
        if link not in hw.links:
            raise ValueError(f"axis {axis!r} is said to cross link {link!r}; {hw.name} has {', '.join(hw.links)}")
    walk = _Walk(hlo_text, hw, axis_links, mesh, n_devices, placement)
    s = walk.span(walk.entry)
    collectives = sorted(s.colls.values(), key=lambda c: (KINDS.index(c.kind) if c.kind in KINDS else 99, c.link, c.axes))
    fresh = fresh_bytes / hw.fresh_memory_bandwidth if hw.fresh_memory_bandwidth and fresh_bytes > 0 else 0.0
    seconds = max(s.seconds + fresh, 1e-12)
    exposed = sum(c.exposed for c in collectives)
    peak = hw.peak(compute_dtype)
    mfu = model_flops_per_step / (n_devices * peak * seconds) if model_flops_per_step and peak else None
    result = StepTime(
        hardware=hw.name, seconds=seconds, compute_s=s.compute, memory_s=s.memory, overhead_s=s.overhead,
        collective_s=sum(c.seconds for c in collectives), exposed_collective_s=exposed, collectives=collectives,
        tokens_per_s=tokens_per_step / seconds, tokens_per_s_per_device=tokens_per_step / seconds / max(n_devices, 1),
        mfu=mfu, bottleneck="", flops=s.flops, hbm_bytes=s.bytes, ops=int(round(s.ops)), kernel_flops=s.kernel_flops,
        notes=sorted(walk.notes), fresh_memory_s=fresh, fp8_flops=s.fp8_flops,
        gemm_flops=s.gemm_flops,
    )  # fmt: skip
    result.bottleneck = bottleneck(result, hw)
    return result


def worst_collective(st: StepTime) -> Optional[CollectiveTime]:
    """The collectives (of one kind, link and mesh axes) that expose the most time; None without any."""
    return max(st.collectives, key=lambda c: c.exposed, default=None)


def bottleneck(st: StepTime, hw: Hardware) -> str:
    """One line naming what the step waits on most."""
    parts = {"compute": st.compute_s, "memory": st.memory_s, "overhead": st.overhead_s, "communication": st.exposed_collective_s,
             "fresh": st.fresh_memory_s}  # fmt: skip
    what = max(parts, key=parts.get)
    share = parts[what] / st.seconds
    if what == "communication":
        worst = worst_collective(st)
        link = hw.links[worst.link]
        axes = f"{worst.axes} " if worst.axes else ""
        return (f"communication-bound: {share:.0%} of the step waits on collectives; the {axes}{worst.kind}s cross "
                f"{worst.link} at {format_si(link.effective, 'B/s')} effective and expose {format_seconds(worst.exposed)} "
                f"of {format_seconds(worst.seconds)}")  # fmt: skip
    if what == "compute":
        return (f"compute-bound: {share:.0%} of the step in matrix products ({format_si(st.flops, 'FLOP')} per device; GEMMs "
                f"at {hw.matmul_efficiency:.0%} of the peak); collectives hidden but {format_seconds(st.exposed_collective_s)}")
    if what == "memory":
        return (f"memory-bound: {share:.0%} of the step in ops limited by HBM ({format_si(hw.hbm_bandwidth * hw.memory_efficiency, 'B/s')} "
                "effective): elementwise work, copies, small matmuls")
    if what == "fresh":
        return (f"allocation-bound: {share:.0%} of the step writes the buffers the runtime maps anew each step "
                f"(page faults, {format_si(hw.fresh_memory_bandwidth or 0.0, 'B/s')})")
    return f"launch-bound: {share:.0%} of the step is {st.ops:,} op launches x {format_seconds(hw.op_overhead)}"


def format_si(value: float, unit: str) -> str:
    """``3.02 TB/s``, ``4.1 GB/s``, ``850 MB/s``; ``1,234 TFLOP``, ``8.6 GFLOP``: three figures
    in the largest prefix that leaves one before the point (an XLA:CPU device's bandwidth is
    a few GB/s, an accelerator's a few TB/s; the same line serves both)."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            x = value / scale
            return f"{x:,.0f} {prefix}{unit}" if x >= 100 else f"{x:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def format_seconds(seconds: float) -> str:
    """``1.83 s``, ``17.6 ms``, ``335 us``."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def format_lines(st: StepTime, target_name: str = "") -> list[str]:
    """The plan's step-time section."""
    where = f" on {target_name}" if target_name else ""
    mfu = f", MFU {st.mfu:.1%}" if st.mfu is not None else ""
    colls = [(f"{c.kind} over {c.link}" + (f" ({c.axes})" if c.axes else ""), c) for c in st.collectives if c.seconds]
    w = max([34] + [len(label) + 1 for label, _ in colls])
    lines = [
        f"step time{where} (predicted: roofline over the compiled schedule, {st.hardware})",
        f"  {format_seconds(st.seconds)} per step; {st.tokens_per_s:,.0f} tokens/s, {st.tokens_per_s_per_device:,.0f} per device{mfu}",
        f"  {'compute-bound ops':<{w}}{format_seconds(st.compute_s):>11}",
        f"  {'memory-bound ops':<{w}}{format_seconds(st.memory_s):>11}",
        f"  {'op launches':<{w}}{format_seconds(st.overhead_s):>11}  {st.ops:,} ops",
    ]
    if st.fresh_memory_s:
        lines.append(f"  {'buffers mapped anew (page faults)':<{w}}{format_seconds(st.fresh_memory_s):>11}")
    if st.fp8_flops:
        gemm = st.gemm_flops
        other = st.flops - gemm
        kernels = f"; with the attention kernels' {other / 1e12:,.0f} (not FP8), {st.fp8_share:.1%} of all" if other > 0 else ""
        lines.append(f"  {'FP8 share of the GEMMs':<{w}}{st.fp8_gemm_share:>11.1%}  {st.fp8_flops / 1e12:,.0f} of "
                     f"{gemm / 1e12:,.0f} TFLOP per device on FP8 operands, at the chip's FP8 peak{kernels}")  # fmt: skip
    for label, c in colls:
        lines.append(f"  {label:<{w}}{format_seconds(c.seconds):>11}  {format_seconds(c.exposed)} exposed, "
                     f"{format_seconds(max(c.seconds - c.exposed, 0.0))} hidden behind compute")  # fmt: skip
    lines.append(f"  bottleneck: {st.bottleneck}")
    lines += [f"  note: {n}" for n in st.notes]
    return lines


def fresh_bytes_of(memory_analysis) -> float:
    """Per device, the bytes a compiled program maps anew each run: its temporary buffer and
    its outputs not aliased to (donated) inputs, from ``compiled.memory_analysis()``; 0 where
    there is none."""
    if memory_analysis is None:
        return 0.0
    get = lambda name: float(getattr(memory_analysis, name, 0) or 0)  # noqa: E731
    return get("temp_size_in_bytes") + max(get("output_size_in_bytes") - get("alias_size_in_bytes"), 0.0)


def rank_by_time(plans: list) -> list:
    """Plans (:class:`~nnxscale.planning.report.StepPlan`) fastest first by predicted step time:
    those that fit and have a prediction, then those without one (by peak memory), then those
    that do not fit."""
    def key(p):
        fits = p.fits is not False
        st = getattr(p, "step_time", None)
        return (not fits, st is None, st.seconds if st is not None else 0.0, p.peak_bytes)

    return sorted(plans, key=key)
