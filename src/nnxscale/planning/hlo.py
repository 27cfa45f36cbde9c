"""What a compiled program communicates: its collectives by kind, counted through loops.

Reads the text of a compiled, SPMD-partitioned XLA module (``compiled.as_text()``), where
every shape is already a per-device shape. Each collective is counted once per execution:
an op inside the body of a ``while`` loop (a ``jax.lax.scan`` over layers, gradient
accumulation) runs ``known_trip_count`` times, which XLA records on the loop.

Bytes are the size of the tensor a device takes part in, per execution (the convention of
the ZeRO and FSDP papers, in which FSDP moves "3x the parameters" per step):

- ``all-gather``: the gathered result (the full tensor);
- ``reduce-scatter``: the input being reduced (result x group size);
- ``all-reduce``, ``all-to-all``, ``collective-permute``, ``collective-broadcast``: the
  buffer.

A ring implementation puts about ``(n-1)/n`` of that on the wire per device for a gather,
a scatter or an all-to-all, twice that for an all-reduce, and a permute sends its whole
buffer; :func:`wire_bytes` applies those factors.
Asynchronous pairs (``all-gather-start`` / ``-done``) count once, at the start.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

#: Collective kinds, in the order reports list them.
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "collective-broadcast")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_CALLEE = re.compile(r"\b(?:body|calls)=%([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled program.

    ``bytes`` is per device and per execution (see the module docstring); ``executions``
    is how often one run of the program executes it (loop trip counts multiplied);
    ``group`` the number of devices taking part.
    """

    kind: str
    name: str
    computation: str
    bytes: int
    executions: int
    group: int

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.executions


def _shape_bytes(text: str) -> list[int]:
    """Bytes of each array shape written in ``text`` (a type: one array or a tuple)."""
    out = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype not in _DTYPE_BYTES:
            continue
        count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        out.append(int(count * _DTYPE_BYTES[dtype]))
    return out


def _split_type(rhs: str) -> tuple[str, str]:
    """``"f32[8]{0} all-gather(...)"`` -> ``("f32[8]{0}", "all-gather(...)")``; tuples too."""
    if rhs.startswith("("):
        depth = 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rhs[: i + 1], rhs[i + 1 :].strip()
    head, _, rest = rhs.partition(" ")
    return head, rest.strip()


def _group_size(line: str) -> int:
    """Devices per replica group, from any of XLA's three ways of writing the groups."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\S+)?\s*\{([^}]*)\}", line)
    if m:
        sizes = {k.strip("'\" "): int(v) for k, v in re.findall(r"([^,=]+)=(\d+)", m.group(1))}
        named = [a.strip("'\" ") for a in m.group(2).split(",") if a.strip()]
        return math.prod(sizes.get(a, 1) for a in named)
    m = re.search(r"replica_groups=\{\{([^}]*)\}", line)
    if m:
        return len([d for d in m.group(1).split(",") if d.strip()])
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    if m:
        return int(m.group(1).split(",")[-1])
    return 1


def _parse(hlo_text: str):
    """Computations -> (collectives found, [(callee, multiplier)])."""
    comps: dict[str, dict] = {}
    entry = None
    current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            comps[current] = {"ops": [], "calls": []}
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rhs = m.groups()
        type_text, rest = _split_type(rhs)
        opcode = rest.split("(", 1)[0].strip()
        trip = 1
        if opcode == "while":
            t = _TRIP.search(line)
            trip = int(t.group(1)) if t else 1
        for callee in _CALLEE.findall(line):
            comps[current]["calls"].append((callee, trip))
        b = _BRANCHES.search(line)
        if b:  # a conditional runs one branch: each is counted as if it ran
            for callee in re.findall(r"%([\w.\-]+)", b.group(1)):
                comps[current]["calls"].append((callee, 1))
        kind = opcode.removesuffix("-start")
        if kind in KINDS and not opcode.endswith("-done"):
            sizes = _shape_bytes(type_text)
            group = _group_size(line)
            if opcode.endswith("-start") and kind in ("all-gather", "collective-permute"):
                nbytes = max(sizes, default=0)  # (operand, result[, contexts]): the result
            else:
                nbytes = sum(sizes)
            if kind == "reduce-scatter":
                nbytes *= group
            comps[current]["ops"].append((kind, name, nbytes, group))
    return comps, entry


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled module, with how often one run executes it."""
    comps, entry = _parse(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text: pass compiled.as_text()")
    runs: dict[str, int] = {}

    def visit(name: str, times: int, depth: int = 0) -> None:
        if name not in comps or depth > 64:
            return
        runs[name] = runs.get(name, 0) + times
        for callee, trip in comps[name]["calls"]:
            visit(callee, times * trip, depth + 1)

    visit(entry, 1)
    out = []
    for comp, times in runs.items():
        for kind, name, nbytes, group in comps[comp]["ops"]:
            out.append(Collective(kind, name, comp, nbytes, times, group))
    return out


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
