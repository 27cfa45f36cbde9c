"""Collectives of a compiled program counted op by op, independently of ``planning/hlo.py``.

Reads ``compiled.as_text()``: every collective once per execution (an async ``-start`` /
``-done`` pair once, at its start), its bytes the largest array of its type (a tuple's
outputs summed where it has several, for a combined collective), multiplied by the
``known_trip_count`` of every ``while`` loop around it (nested loops multiply).
Bytes are per device: the gathered result of an all-gather, the input of a
reduce-scatter, the buffer of an all-reduce.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
          "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_CALLS = re.compile(r"\b(?:body|calls|to_apply|condition|branch_computations)=\{?%([\w.\-]+)")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def arrays(text: str) -> list[int]:
    """Bytes of each array written in ``text``."""
    return [math.prod(int(d) for d in dims.split(",") if d) * _BYTES[t] for t, dims in _ARRAY.findall(text) if t in _BYTES]


def ops(hlo: str) -> list[tuple[str, int, int]]:
    """``(kind, bytes per execution, executions)`` of every collective of the module."""
    bodies: dict[str, str] = {}
    current = None
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)  # computation -> (callee, times)
    found: list[tuple[str, str, int, str]] = []
    for line in hlo.splitlines():
        head = _HEADER.match(line)
        if head:
            current = head.group(1)
            continue
        if current is None:
            continue
        loop = _WHILE_BODY.search(line)
        if loop:
            trip = _TRIP.search(line)
            calls[current].append((loop.group(1), int(trip.group(1)) if trip else 1))
        else:
            for callee in _CALLS.findall(line):
                calls[current].append((callee, 1))
        op = _OP.match(line)
        if op:
            found.append((current, op.group(2), sum(arrays(_results(op.group(2) + (op.group(3) or ""), op.group(1)))), line))
    times: dict[str, int] = {}

    def visit(name: str, n: int):
        times[name] = times.get(name, 0) + n
        for callee, k in calls.get(name, ()):
            visit(callee, n * k)

    entry = re.search(r"^ENTRY\s+%([\w.\-]+)", hlo, re.M).group(1)
    visit(entry, 1)
    out = []
    for comp, kind, nbytes, line in found:
        if kind == "reduce-scatter":  # the input reduced: result x group size
            nbytes *= _group(line)
        out.append((kind, nbytes, times.get(comp, 0)))
    return out


def _results(kind: str, type_: str) -> str:
    """The results of a collective's type: an async all-gather's, reduce-scatter's or
    permute's start is ``(operands, results)``, each one array or a tuple of them."""
    if not kind.endswith("-start") or kind == "all-reduce-start" or not type_.startswith("("):
        return type_
    depth = 0
    for i, ch in enumerate(type_):
        depth += ch in "(["
        depth -= ch in ")]"
        if ch == "," and depth == 1:
            return type_[i + 1 :]
    return type_


def _group(line: str) -> int:
    """Devices in one replica group: ``{{0,1,...},...}``, ``[groups,size]<=[n]`` or
    ``mesh['a'=2,'b'=4] {'b'}``."""
    listed = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if listed:
        return len(listed.group(1).split(","))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if iota:
        return int(iota.group(2))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes[k] for k in re.findall(r"'([^']+)'", mesh.group(2)))
    return 1


def totals(hlo: str) -> dict[str, int]:
    """Bytes per step per device, by kind."""
    out = dict.fromkeys(KINDS, 0)
    for kind, nbytes, n in ops(hlo):
        out[kind] += nbytes * n
    return out
