"""What a compiled program communicates: its collectives by kind, counted through loops.

Reads the text of a compiled, SPMD-partitioned XLA module (``compiled.as_text()``, its
computations and instructions as :mod:`nnxscale.sharding.hlo_text` reads them), where
every shape is already a per-device shape, from any backend's compiler (XLA:CPU, the
CUDA plugin's, libtpu's). Each collective is counted once per execution: an op inside the
body of a ``while`` loop (a ``jax.lax.scan`` over layers, gradient accumulation, a ring)
runs as many times as the loop turns, nested loops multiplied.

Bytes are the size of the tensor a device takes part in, per execution (the convention of
the ZeRO and FSDP papers, in which FSDP moves "3x the parameters" per step), in the dtype
the compiler chose (a float32 step may all-to-all in bfloat16 on TPU):

- ``all-gather``: the gathered result (the full tensor);
- ``reduce-scatter``: the input being reduced (result x group size);
- ``all-reduce``, ``all-to-all``, ``collective-permute``, ``collective-broadcast``: the
  buffer.

A ring implementation puts about ``(n-1)/n`` of that on the wire per device for a gather,
a scatter or an all-to-all, twice that for an all-reduce, and a permute sends its whole
buffer; :func:`wire_bytes` applies those factors.

How each backend writes the same things, all read here:

- Asynchronous pairs count once, at the start: ``all-gather-start`` / ``-done`` (GPU, with
  tuple shapes ``(operands, results[, contexts])``, several tensors combined into one op),
  ``async-start`` wrapping a computation (``calls=``), and TPU's async collective fusions
  (one collective copied into a start fusion, overlapped fusions and a done fusion; counted
  in the fusion that starts it, the one with a ``AsyncCollectiveStart`` custom call).
- TPU reduce-scatters appear as an ``all-reduce`` inside a fusion computation named
  ``all-reduce-scatter``: counted as the reduce-scatter they are.
- Loop trip counts come from ``known_trip_count`` (GPU, CPU) or, where the compiler does
  not record it (TPU), from the loop itself: a counter from a constant, stepped by a
  constant, compared with a constant. A loop to a count the data decides (a ``fori_loop``
  to the expert tiles in use, :mod:`nnxscale.layers.moe`) turns as often as its code
  expects (:func:`nnxscale.layers.trips.expected_trips`, kept in its metadata), else at its
  most (:func:`trip_bound`): :func:`loop_turns`, as the step-time prediction counts it. A
  loop whose count cannot be read is counted once. Either way its ops say so
  (``trips_known=False``).
- A ``conditional`` runs one branch: the branch moving the most bytes is counted (an upper
  bound), the others are listed with ``executions=0``; all say ``in_branch=True``.
- Collective matmuls (windowed einsums) are collective-permutes in a loop: counted as such.
- Across TPU slices (a multi-slice target, ``2xv6e-256``), each slice runs its own SPMD
  program and the collectives over DCN are host transfers: a ``send`` / ``recv`` pair marked
  ``_xla_megascale_transfer_type`` (``ALL_GATHER``, ``ALL_REDUCE``, ...) and
  ``_xla_megascale_target="{slices}x{devices}"``; counted at the ``send`` as the collective
  of that kind over the slices (an all-gather's bytes the send's buffer x the slices).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

import numpy as np

from nnxscale.layers.trips import EXPECTED_TRIPS_PREFIX
from nnxscale.sharding.hlo_text import KINDS, Computation, Instruction, callees, collective_kind, named_computation, read_module

#: Bytes per element of each HLO element type.
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e3m4": 1,
    "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
}  # fmt: skip
#: Which slices a DCN host transfer ``send`` spans (see the module docstring).
_MEGASCALE_SLICES = re.compile(r'_xla_megascale_target="\{([^}]*)\}x')  # "{slices}x{devices in a slice}"
_MEGASCALE_DEVICES = re.compile(r"_xla_megascale_target=\{\{([\d,]+)\}")  # {{global ids}}: slice x 100000 + device


def megascale_slices(attrs: str) -> int | None:
    """How many slices a DCN host transfer spans, or None where ``attrs`` names none:
    ``_xla_megascale_target="{1,2,3,4}x{0:3}"`` (slices by id, ranges ``a:b`` counting
    ``b - a + 1``, then the devices of each): 4; ``_xla_megascale_target={{100000,...,200015}}``
    (an all-to-all's devices, slice x 100000 + device): the slices among them."""
    m = _MEGASCALE_SLICES.search(attrs)
    if m is None:
        d = _MEGASCALE_DEVICES.search(attrs)
        return len({int(x) // 100000 for x in d.group(1).split(",") if x}) if d else None
    n = 0
    for part in filter(None, (p.strip() for p in m.group(1).split(","))):
        lo, _, hi = part.partition(":")
        n += int(hi) - int(lo) + 1 if hi else 1
    return n or None


_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
#: The JAX operation an instruction came from, in its metadata.
OP_NAME = re.compile(r'\bop_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled program.

    ``bytes`` is per device and per execution (see the module docstring); ``executions``
    is how often one run of the program executes it (loop trip counts multiplied);
    ``group`` the number of devices taking part. ``dtype`` is the element type the compiler
    chose (``"bf16"``; several joined by ``+`` for an op that combines tensors of different
    types) and ``shapes`` the per-device shapes counted (the gathered results, the
    reduce-scatter inputs). ``trips_known`` is False inside a loop whose trip count could
    not be read (counted as one trip); ``in_branch`` is True inside a ``conditional``.
    ``source`` is the JAX operation it came from (the HLO metadata's ``op_name``), if any.
    """

    kind: str
    name: str
    computation: str
    bytes: int
    executions: int
    group: int
    dtype: str = ""
    shapes: tuple[tuple[int, ...], ...] = ()
    trips_known: bool = True
    in_branch: bool = False
    source: str = ""

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.executions


# --------------------------------------------------------------------------------------
# reading the text
# --------------------------------------------------------------------------------------


def leaves(t) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays ``(dtype, dims)`` of an instruction's type, a tuple's flattened."""
    if isinstance(t, list):
        return [leaf for item in t for leaf in leaves(item)]
    return [t]


def _group_size(attrs: str, devices: int) -> int:
    """Devices per replica group, from any of XLA's ways of writing the groups."""
    groups = group_members(attrs, devices, pairs=False, order=False)
    return len(groups[0]) if groups else 1


def group_members(attrs: str, devices: int, *, pairs: bool = True, order: bool = True) -> list[list[int]] | None:
    """The replica groups of a collective as lists of device ids, in any of XLA's forms, or
    ``None`` where it writes none; with ``pairs`` a permute's ``source_target_pairs`` too.
    ``order=False`` ignores a mesh form's ``device_ids`` (the groups' sizes do not depend on them)."""
    m = re.search(r"source_target_pairs=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", attrs) if pairs else None
    if m:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{([\d,]+)\}", m.group(1))]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=(\S+))?\s*\{([^}]*)\}", attrs)
    if m:
        sizes = [(k.strip("'\" "), int(v)) for k, v in re.findall(r"([^,=]+)=(\d+)", m.group(1))]
        names = [n for n, _ in sizes]
        grid = np.arange(math.prod(s for _, s in sizes)).reshape([s for _, s in sizes])
        if m.group(2) and order:
            ids = _iota_list(m.group(2).rstrip(","))
            if ids is None or len(ids) != grid.size:
                return None
            grid = np.asarray(ids).reshape(grid.shape)
        over = [names.index(a.strip("'\" ")) for a in m.group(3).split(",") if a.strip("'\" ") in names]
        rest = [k for k in range(len(names)) if k not in over]
        return grid.transpose(rest + over).reshape(-1, math.prod(grid.shape[k] for k in over) if over else 1).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)+)\}", attrs)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", attrs)
    if m:
        shape = [int(x) for x in re.match(r"\[([\d,]+)\]", m.group(1)).group(1).split(",")]
        ids = _iota_list(m.group(1))
        return None if ids is None else [ids[i : i + shape[-1]] for i in range(0, len(ids), shape[-1])]
    if re.search(r"replica_groups=\{\}", attrs):
        return [list(range(devices))]
    return None


def _iota_list(text: str) -> list[int] | None:
    """``[2,4]<=[4,2]T(1,0)`` or ``([4,2]T(1,0))`` (an iota reshaped and transposed) or
    ``{0,1,...}`` as a flat list."""
    m = re.fullmatch(r"\[[\d,]+\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    m = m or re.fullmatch(r"\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", text.strip())
    if m:
        dims = [int(x) for x in m.group(1).split(",")]
        grid = np.arange(math.prod(dims)).reshape(dims)
        if m.group(2):
            grid = grid.transpose([int(x) for x in m.group(2).split(",")])
        return grid.reshape(-1).tolist()
    m = re.fullmatch(r"\{([\d,]+)\}", text.strip())
    return [int(x) for x in m.group(1).split(",")] if m else None


def _dimension(attrs: str) -> int | None:
    m = re.search(r"\bdimensions=\{(\d+)\}", attrs)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------------------
# one op
# --------------------------------------------------------------------------------------


def as_collective(comp: Computation, instr: Instruction, devices: int) -> Collective | None:
    """``instr`` as a collective executed once, if it is one to count where it stands
    (:func:`~nnxscale.sharding.hlo_text.collective_kind`)."""
    kind = collective_kind(comp, instr)
    if kind is None:
        return None
    if instr.opcode == "send":  # a DCN host transfer
        return _megascale(comp, instr, kind)
    asynchronous = instr.opcode.endswith("-start")
    base = instr.opcode.removesuffix("-start")
    group = _group_size(instr.attrs, devices)
    t = instr.type
    if asynchronous and base != "all-reduce" and isinstance(t, list) and len(t) >= 2:
        t = t[0] if kind == "reduce-scatter" else t[1]  # (operands, results[, contexts])
        arrays = leaves(t)
    else:
        arrays = leaves(t)
        if kind == "reduce-scatter" and base == "reduce-scatter":  # the result: scale back
            dim = _dimension(instr.attrs)
            arrays = [(dt, tuple(d * group if k == dim else d for k, d in enumerate(dims))) for dt, dims in arrays]
    return _record(comp, instr, kind, group, arrays)


def _record(comp: Computation, instr: Instruction, kind: str, group: int, arrays: list) -> Collective:
    """The :class:`Collective` of ``instr`` moving ``arrays`` (``(dtype, dims)``; tokens and
    other non-array leaves dropped), executed once."""
    arrays = [(dt, dims) for dt, dims in arrays if dt in DTYPE_BYTES and dt != "token"]
    nbytes = int(sum(math.prod(dims) * DTYPE_BYTES[dt] for dt, dims in arrays))
    dtype = "+".join(dict.fromkeys(dt for dt, _ in arrays))
    source = OP_NAME.search(instr.attrs)
    shapes = tuple(dims for _, dims in arrays)
    return Collective(kind, instr.name, comp.name, nbytes, 1, group, dtype, shapes, source=source.group(1) if source else "")


def _megascale(comp: Computation, instr: Instruction, kind: str) -> Collective:
    """A DCN host transfer ``send`` as the collective it is: its buffer (the first element of
    ``(data, u32[], token[])``), for an all-gather times the slices (the gathered result)."""
    n = megascale_slices(instr.attrs) or 1
    t = instr.type[0] if isinstance(instr.type, list) and instr.type else instr.type
    scale = 1  # an all-gather's result: the matching recv's buffer (the same token), else the send's x the slices
    if kind == "all-gather":
        token = instr.operands[1] if len(instr.operands) > 1 else None
        recv = next((i for i in comp.instrs.values() if i.opcode == "recv" and i.operands[:1] == [token]), None)
        if recv is not None and isinstance(recv.type, list) and recv.type:
            t = recv.type[0]
        else:
            scale = n
    arrays = leaves(t)
    if scale > 1:
        arrays = [(dt, (*dims[:-1], dims[-1] * scale) if dims else (scale,)) for dt, dims in arrays]
    return _record(comp, instr, kind, n, arrays)


# --------------------------------------------------------------------------------------
# loops
# --------------------------------------------------------------------------------------


def underlying(comp: Computation, name: str) -> Instruction | None:
    """The instruction ``name`` stands for, looking through copies and bitcasts."""
    seen = 0
    instr = comp.instrs.get(name)
    while instr is not None and instr.opcode in ("copy", "bitcast", "convert", "reshape") and seen < 32:
        instr = comp.instrs.get(instr.operands[0]) if instr.operands else None
        seen += 1
    return instr


def _constant(comp: Computation, name: str) -> int | None:
    instr = underlying(comp, name)
    if instr is None or instr.opcode != "constant" or isinstance(instr.type, list) or instr.type[1]:
        return None
    return int(instr.args) if re.fullmatch(r"\s*-?\d+\s*", instr.args) else None


def _counter(comp: Computation, name: str) -> int | None:
    """The tuple index of a loop parameter that ``name`` reads, if it is one."""
    instr = underlying(comp, name)
    if instr is None or instr.opcode != "get-tuple-element":
        return None
    param = comp.instrs.get(instr.operands[0]) if instr.operands else None
    m = re.search(r"\bindex=(\d+)", instr.attrs)
    return int(m.group(1)) if m and param is not None and param.opcode == "parameter" else None


_FLIPPED = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}


def _given(fused: Computation, fusion: Instruction, name: str) -> str:
    """The operand ``fusion`` passes for ``name``, a parameter of its computation ``fused``
    (``""`` where ``name`` is no parameter)."""
    param = underlying(fused, name)
    k = int(param.args) if param is not None and param.opcode == "parameter" and param.args.strip().isdigit() else -1
    return fusion.operands[k] if 0 <= k < len(fusion.operands) else ""


def _compare(comps: dict[str, Computation], comp: Computation, constant_bound: bool = True) -> tuple[int, str, int | None] | None:
    """``(index, direction, bound)`` when loop condition ``comp`` is ``param[index] <direction> bound``;
    ``constant_bound=False``: also where the bound is not a constant (``None`` then)."""
    root, where, outside = comp.instrs.get(comp.root), comp, None
    if root is not None and root.opcode == "fusion" and callees(root):  # the compare fused: read it inside
        where, outside = comps.get(callees(root)[0]), root
        root = where.instrs.get(where.root) if where else None
    if root is None or root.opcode != "compare" or len(root.operands) < 2:
        return None
    m = re.search(r"direction=(\w+)", root.attrs)
    counter, bound, direction = *root.operands[:2], m.group(1) if m else ""
    if _constant(where, counter) is not None:  # written "bound > counter"
        counter, bound, direction = bound, counter, _FLIPPED.get(direction, "")
    bound = _constant(where, bound)
    if outside is not None:  # a parameter of the fusion: the operand it was given
        counter = _given(where, outside, counter)
    index = _counter(comp, counter)
    return None if (bound is None and constant_bound) or index is None or not direction else (index, direction, bound)


def _loop_counter(comps: dict[str, Computation], caller: Computation, loop: Instruction, constant_bound: bool = True, fused_step: bool = True):
    """``(index, direction, bound, start, step, body, root)`` of a ``while`` whose condition
    compares a tuple element (its counter) with a bound (a constant, or anything with
    ``constant_bound=False``: ``None`` then) and whose body adds a constant ``step`` to it
    (the add fused too where ``fused_step``); ``start``: the counter's first value where it
    is a constant."""
    cond = comps.get(named_computation(loop.attrs, "condition") or "")
    body = comps.get(named_computation(loop.attrs, "body") or "")
    if cond is None or body is None or not loop.operands:
        return None
    test = _compare(comps, cond, constant_bound)
    init_tuple = underlying(caller, loop.operands[0])
    root = body.instrs.get(body.root)
    if test is None or init_tuple is None or init_tuple.opcode != "tuple" or root is None or root.opcode != "tuple":
        return None
    index, direction, bound = test
    if index >= len(init_tuple.operands) or index >= len(root.operands):
        return None
    update = underlying(body, root.operands[index])
    inner = comps.get(callees(update)[0]) if update is not None and update.opcode == "fusion" and callees(update) else None
    add = underlying(inner, inner.root) if inner is not None else update
    if add is None or add.opcode != "add" or len(add.operands) != 2 or (inner is not None and not fused_step):
        return None
    if inner is None:
        a, b = add.operands
        step = _constant(body, b) if _counter(body, a) == index else _constant(body, a) if _counter(body, b) == index else None
    else:  # the add fused: the counter passed in, the step a constant inside or passed in
        if not any(_counter(body, o) == index for o in update.operands):
            return None
        steps = [_constant(inner, o) for o in add.operands] + [_constant(body, o) for o in update.operands]
        step = 1 if 1 in steps else next((x for x in steps if x is not None), None)
    return index, direction, bound, _constant(caller, init_tuple.operands[index]), step, body, root


def trip_count(comps: dict[str, Computation], caller: Computation, loop: Instruction) -> int | None:
    """How often a ``while`` turns: recorded by the compiler, or read from the loop."""
    m = _TRIP.search(loop.attrs)
    if m:
        return int(m.group(1))
    counter = _loop_counter(comps, caller, loop, fused_step=False)
    if counter is None:
        return None
    _, direction, bound, start, step, _, _ = counter
    if start is None or not step or step <= 0 or direction not in ("LT", "LE", "NE"):
        return None
    stop = bound + 1 if direction == "LE" else bound
    return max(0, -(-(stop - start) // step))


def trip_bound(comps: dict[str, Computation], caller: Computation, loop: Instruction) -> int | None:
    """At most how often a ``while`` turns whose bound is data (a ``fori_loop`` to a computed
    count, such as the expert tiles in use): the extent of the carried buffers its body fills
    a slice per turn, in place (a dynamic-update-slice of the carried buffer), where the counter
    starts at 0 and steps by 1 below the bound. ``None`` where the loop is not of that form."""
    counter = _loop_counter(comps, caller, loop, constant_bound=False)
    if counter is None:
        return None
    index, direction, _, start, step, body, root = counter
    if direction not in ("LT", "NE") or start != 0 or step != 1:
        return None
    extents = []
    for k, name in enumerate(root.operands):
        if k == index:
            continue
        writer = underlying(body, name)
        where = comps.get(callees(writer)[0]) if writer is not None and writer.opcode == "fusion" and callees(writer) else body
        dus = underlying(where, where.root if where is not body else name) if where is not None else None
        if dus is None or dus.opcode != "dynamic-update-slice" or len(dus.operands) < 2:
            continue
        target, piece = where.instrs.get(dus.operands[0]), where.instrs.get(dus.operands[1])
        if target is None or piece is None or isinstance(target.type, list) or isinstance(piece.type, list):
            continue
        full, part = target.type[1], piece.type[1]
        dims = [d for d, (a, b) in enumerate(zip(full, part)) if b == 1 and a > 1]
        if len(full) != len(part) or not dims or len(dus.operands) <= 2 + dims[0]:
            continue
        at = dus.operands[2 + dims[0]]  # the start index along the sliced dimension
        if where is not body:  # a parameter of the fusion: the operand the body gave it
            at = _given(where, writer, at)
        if _from_counter(comps, body, at, index):
            extents.append(full[dims[0]])
    return min(extents) if extents else None


_EXPECTED = re.compile(rf"\b{EXPECTED_TRIPS_PREFIX}(\d+)\b")  # nnxscale.layers.trips's name scope


def loop_turns(comps: dict[str, Computation], caller: Computation, loop: Instruction) -> tuple[int | None, str]:
    """How often a ``while`` is counted to turn, and how that was read: ``"count"`` (recorded
    by the compiler or read from the loop, :func:`trip_count`); for a loop to a count the data
    decides, ``"expected"`` (as often as its code expects: the innermost
    :func:`nnxscale.layers.trips.expected_trips` scope in its metadata) or ``"bound"`` (at its
    most, :func:`trip_bound`); ``(None, "unknown")`` where none can be read."""
    trip = trip_count(comps, caller, loop)
    if trip is not None:
        return trip, "count"
    if expected := _EXPECTED.findall(loop.attrs):
        return int(expected[-1]), "expected"
    trip = trip_bound(comps, caller, loop)
    return (trip, "bound") if trip is not None else (None, "unknown")


def _from_counter(comps: dict[str, Computation], body: Computation, name: str, index: int, depth: int = 0) -> bool:
    """Whether scalar ``name`` of a loop body is computed from the counter (tuple element
    ``index``) and constants alone (the counter itself, or it wrapped or offset)."""
    if _counter(body, name) == index:
        return True
    instr = underlying(body, name)
    if instr is None or depth > 8 or instr.opcode not in ("fusion", "add", "subtract", "select", "compare", "clamp"):
        return False
    return any(_counter(body, o) == index or _from_counter(comps, body, o, index, depth + 1) for o in instr.operands) and all(
        _constant(body, o) is not None or _counter(body, o) == index or _from_counter(comps, body, o, index, depth + 1)
        for o in instr.operands
    )


# --------------------------------------------------------------------------------------
# the program
# --------------------------------------------------------------------------------------


def _per_run(hlo_text: str, visit, weight) -> list:
    """Every record ``visit(comp, instr, devices)`` makes of a compiled module (an op executed
    once, or None), with how often one run executes it: loop bodies times their trip count
    (nested loops multiplied), the heaviest branch of a ``conditional`` by ``weight``."""
    comps, entry, devices = read_module(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text: pass compiled.as_text()")
    memo: dict[str, list] = {}

    def expand(name: str, depth: int = 0) -> list:
        """The records one run of computation ``name`` executes, through what it calls."""
        comp = comps.get(name)
        if name in memo or comp is None or depth > 64:
            return memo.get(name, [])
        out = []
        for instr in comp.instrs.values():
            op = visit(comp, instr, devices)
            out += [op] if op is not None else []
            if instr.opcode.endswith("-done") or instr.opcode == "async-update":
                continue  # they name the computation their start already called
            if instr.opcode == "while":
                trip, how = loop_turns(comps, comp, instr)
                for key, extra in (("body", 0), ("condition", 1)):  # the condition runs once more
                    for op in expand(named_computation(instr.attrs, key) or "", depth + 1):
                        runs, known = op.executions * ((trip or 1) + extra), op.trips_known and how == "count"
                        out.append(dataclasses.replace(op, executions=runs, trips_known=known))
            elif instr.opcode == "conditional":
                branches = [expand(b, depth + 1) for b in callees(instr)]
                heaviest = max(branches, key=lambda ops: sum(weight(op) for op in ops), default=None)
                for ops in branches:
                    out += [dataclasses.replace(op, executions=op.executions * (ops is heaviest), in_branch=True) for op in ops]
            else:
                for callee in callees(instr):
                    out += expand(callee, depth + 1)
        memo[name] = out
        return out

    merged: dict[tuple[str, str], object] = {}
    for op in expand(entry):
        seen = merged.get((op.computation, op.name))
        if seen is not None:  # the same op reached along two paths: add up its runs
            op = dataclasses.replace(op, executions=op.executions + seen.executions, trips_known=op.trips_known and seen.trips_known,
                                     in_branch=op.in_branch or seen.in_branch)  # fmt: skip
        merged[(op.computation, op.name)] = op
    return list(merged.values())


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled module, with how often one run executes it."""
    return _per_run(hlo_text, as_collective, lambda op: op.total_bytes)


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One matrix product of a compiled program: a ``dot``, or a ``convolution`` (XLA:TPU writes
    matmuls as those). Library calls and kernels (cuBLAS, cuDNN, Pallas) are not read.

    ``flops`` per device and per execution (2 per multiply-add); ``executions`` as for
    :class:`Collective`.
    """

    kind: str  # "dot" or "convolution"
    name: str
    computation: str
    flops: float
    executions: int
    trips_known: bool = True
    in_branch: bool = False
    source: str = ""

    @property
    def total_flops(self) -> float:
        return self.flops * self.executions


def _dims_of(comp: Computation, name: str) -> tuple[int, ...] | None:
    instr = comp.instrs.get(name)
    if instr is None:
        return None
    arrays = leaves(instr.type)
    return arrays[0][1] if len(arrays) == 1 else None


def _int_list(attrs: str, key: str) -> list[int]:
    """An HLO attribute ``key={1,2}``."""
    m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _dot_flops(lhs: tuple[int, ...], rhs: tuple[int, ...], attrs: str) -> float:
    """2 x batch x lhs free x rhs free x contracted, for a ``dot``'s dimension numbers."""
    lc, rc, rb = (_int_list(attrs, k) for k in ("lhs_contracting_dims", "rhs_contracting_dims", "rhs_batch_dims"))
    contract = math.prod(lhs[d] for d in lc)
    lhs_rest = math.prod(n for d, n in enumerate(lhs) if d not in lc)  # batch and free
    rhs_free = math.prod(n for d, n in enumerate(rhs) if d not in rc and d not in rb)
    return 2.0 * lhs_rest * rhs_free * contract


def _window(attrs: str, key: str, n: int, default: int) -> list[int]:
    """A convolution's ``window={size=2x4 stride=1x3 ...}`` entry ``key``, per spatial dimension."""
    m = re.search(rf"\b{key}=([\dx]+)", attrs)
    return [int(p) for p in m.group(1).split("x")] if m else [default] * n


def _conv_flops(lhs: tuple[int, ...], out: tuple[int, ...], rhs: tuple[int, ...], attrs: str) -> float:
    """2 x output elements x input features x the window taps that meet the input.

    XLA:TPU writes matmuls as convolutions, batched ones and outer products among them with
    windows that mostly fall on padding or on the holes of a dilated input (a batch dimension
    as a window over an input dilated by as much, a length-1 input padded to the output's
    length): only the taps that meet an input element count, on average over the output
    positions of each spatial dimension.
    """
    m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
    if not m or "o" not in m.group(2) or "i" not in m.group(2):
        return 0.0
    lhs_l, rhs_l, out_l = m.groups()
    spatial = sorted(c for c in rhs_l if c.isdigit())
    n = len(spatial)
    size, stride = _window(attrs, "size", n, 1), _window(attrs, "stride", n, 1)
    lhs_dil, rhs_dil = _window(attrs, "lhs_dilate", n, 1), _window(attrs, "rhs_dilate", n, 1)
    pad = re.search(r"\bpad=([\d_x\-]+)", attrs)
    lows = [int(p.split("_")[0]) for p in pad.group(1).split("x")] if pad else [0] * n
    taps = 1.0
    for d, c in enumerate(spatial):
        if len(lows) != n or len(size) != n:
            break
        width, outs = lhs[lhs_l.index(c)], out[out_l.index(c)]
        real = (width - 1) * lhs_dil[d] + 1  # the input, dilated
        if outs * size[d] > 1 << 16:  # a real convolution's long window: every tap counts
            taps *= size[d]
            continue
        hits = sum(1 for o in range(outs) for k in range(size[d])
                   if 0 <= (x := o * stride[d] + k * rhs_dil[d] - lows[d]) < real and x % lhs_dil[d] == 0)  # fmt: skip
        taps *= hits / max(outs, 1)
    return 2.0 * math.prod(out) * rhs[rhs_l.index("i")] * taps


def as_matmul(comp: Computation, instr: Instruction, devices: int) -> Matmul | None:
    """``instr`` as a matrix product executed once, if it is one."""
    op = instr.opcode
    if op not in ("dot", "convolution") or len(instr.operands) < 2:
        return None
    lhs, rhs = _dims_of(comp, instr.operands[0]), _dims_of(comp, instr.operands[1])
    out = leaves(instr.type)[0][1] if leaves(instr.type) else None
    if lhs is None or rhs is None or out is None:
        return None
    flops = _dot_flops(lhs, rhs, instr.attrs) if op == "dot" else _conv_flops(lhs, out, rhs, instr.attrs)
    source = OP_NAME.search(instr.attrs)
    return Matmul(op, instr.name, comp.name, flops, 1, source=source.group(1) if source else "")


def matmuls(hlo_text: str) -> list[Matmul]:
    """Every matrix product of a compiled module, with how often one run executes it."""
    return _per_run(hlo_text, as_matmul, lambda m: m.total_flops)


def matmul_flops(hlo_text_or_ops) -> float:
    """FLOPs per device of one run in matrix products, loop bodies counted once per trip
    (a loop to a data-decided count as :func:`loop_turns` counts it: the expert tiles' loops of
    :mod:`nnxscale.layers.moe` as often as they are expected to turn): what the analytical
    ``6N + attention`` per token counts (elementwise work is left out)."""
    ops = matmuls(hlo_text_or_ops) if isinstance(hlo_text_or_ops, str) else hlo_text_or_ops
    return float(sum(m.total_flops for m in ops))


def collective_bytes(hlo_text_or_ops) -> dict[str, int]:
    """``{kind: bytes per device per run}`` for every kind in :data:`KINDS` (zeros included)."""
    ops = collectives(hlo_text_or_ops) if isinstance(hlo_text_or_ops, str) else hlo_text_or_ops
    totals = dict.fromkeys(KINDS, 0)
    for op in ops:
        totals[op.kind] += op.total_bytes
    return totals


def wire_bytes(ops: Iterable[Collective]) -> int:
    """Bytes each device sends per run with ring algorithms (see the module docstring)."""
    total = 0.0
    for op in ops:
        n = max(op.group, 1)
        share = (n - 1) / n  # what leaves a device when each holds 1/n of the tensor
        factor = {"all-reduce": 2 * share, "collective-permute": 1.0, "collective-broadcast": 1.0}.get(op.kind, share)
        total += op.total_bytes * factor
    return int(total)
