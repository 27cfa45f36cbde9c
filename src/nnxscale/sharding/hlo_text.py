"""A compiled XLA module's text, read: its computations, their instructions, its collectives.

Reads ``compiled.as_text()``, a compiled, SPMD-partitioned module from any backend's compiler
(XLA:CPU, the CUDA plugin's, libtpu's), into its computations (:func:`read_module`), and says
which instructions are collectives and of what kind (:func:`collective_kind`) and whether one
run of a program executes any (:func:`runs_collectives`: :func:`nnxscale.sharding.state.compile_init`
asks it of the sharded init). Pure text, no jax. The planner reads the same module with it:
:mod:`nnxscale.planning.hlo` counts what each collective moves and how often,
:mod:`nnxscale.planning.steptime` times the program.

How the backends write a collective, all read here: a synchronous op (``all-gather``), an
asynchronous pair (``all-gather-start`` / ``-done``, counted at its start), TPU's async
collective fusions (counted in the fusion that starts one, the one with an
``AsyncCollectiveStart`` custom call, not in its copies), a TPU reduce-scatter as an
``all-reduce`` inside a computation named ``all-reduce-scatter``, and a collective across TPU
slices as a DCN host transfer: a ``send`` marked ``_xla_megascale_transfer_type``.
"""

from __future__ import annotations

import dataclasses
import re

#: Collective kinds, in the order reports list them.
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "collective-broadcast")

_OPCODES = {"ragged-all-to-all": "all-to-all"}  # opcodes counted under another kind
#: A collective across TPU slices (DCN), written as a host transfer ``send``.
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_MEGASCALE_KINDS = {"ALL_GATHER": "all-gather", "ALL_REDUCE": "all-reduce", "REDUCE_SCATTER": "reduce-scatter",
                    "ALL_TO_ALL": "all-to-all"}  # fmt: skip

_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_CALLED = re.compile(r"\b(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:called_computations|branch_computations)=\{([^}]*)\}")
_NUM_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_REPLICA_COUNT = re.compile(r"\breplica_count=(\d+)")


@dataclasses.dataclass
class Instruction:
    """One instruction of a computation: ``%name = type opcode(operands), attrs``."""

    name: str
    opcode: str
    type: object  # an array (dtype, dims) or a list of types (a tuple)
    operands: list[str]
    attrs: str  # what follows the operands: ", dimensions={0}, metadata={...}, ..."
    args: str = ""  # the text inside the parentheses: operands, or a constant's literal


@dataclasses.dataclass
class Computation:
    """One computation of a module: its instructions by name, in the order written (the
    schedule's, in a scheduled module), and the name of its ``ROOT``."""

    name: str
    instrs: dict[str, Instruction]
    root: str = ""


def _skip_space(s: str, i: int) -> int:
    while i < len(s):
        if s[i].isspace() or s[i] == ",":
            i += 1
        elif s.startswith("/*", i):
            i = s.index("*/", i) + 2
        else:
            break
    return i


def _parse_type(s: str, i: int = 0):
    """``(type, end)`` for the HLO type starting at ``s[i]``: ``(dtype, dims)`` or a list."""
    i = _skip_space(s, i)
    if s[i] == "(":
        items, i = [], i + 1
        while True:
            i = _skip_space(s, i)
            if s[i] == ")":
                return items, i + 1
            item, i = _parse_type(s, i)
            items.append(item)
    m = _ARRAY.match(s, i)
    if not m:
        raise ValueError(f"cannot read an HLO type at {s[i:i + 40]!r}")
    dims = tuple(int(d.lstrip("<=")) for d in m.group(2).split(",") if d.strip())
    i = m.end()
    if i < len(s) and s[i] == "{":  # the layout, e.g. {1,0:T(8,128)(2,1)S(1)}
        i = s.index("}", i) + 1
    return (m.group(1), dims), i


def _closing(s: str, i: int) -> int:
    """Index just past the parenthesis that closes the one at ``s[i]``."""
    depth = 0
    for j in range(i, len(s)):
        depth += s[j] == "("
        depth -= s[j] == ")"
        if depth == 0:
            return j + 1
    return len(s)


def _parse_instr(name: str, rhs: str) -> Instruction:
    type_, i = _parse_type(rhs)
    m = _OPCODE.match(rhs, i)
    if not m:
        return Instruction(name, "", type_, [], rhs[i:])
    start = m.end() - 1
    end = _closing(rhs, start)
    operands = re.findall(r"%([\w.\-]+)", rhs[start:end])
    return Instruction(name, m.group(1), type_, operands, rhs[end:], rhs[start + 1 : end - 1])


def read_module(hlo_text: str) -> tuple[dict[str, Computation], str | None, int]:
    """``(computations, entry name, devices in the module)`` of a module's text."""
    comps: dict[str, Computation] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if not line.startswith(" "):
            header = _HEADER.match(line)
            if header:
                current = Computation(header.group(2), {})
                comps[current.name] = current
                entry = current.name if header.group(1) else entry
                continue
            if line.strip() == "}":
                current = None
            continue
        m = _INSTR.match(line)
        if current is None or not m:
            continue
        try:
            instr = _parse_instr(m.group(2), m.group(3))
        except (ValueError, IndexError) as e:  # a type this reader does not know: harmless unless it is a collective's
            if any(f" {kind}" in m.group(3) for kind in KINDS):
                raise ValueError(f"cannot read the collective %{m.group(2)} in computation %{current.name}: {e}") from None
            continue
        current.instrs[instr.name] = instr
        if m.group(1):
            current.root = instr.name
    head = hlo_text[: hlo_text.find("\n")] if "\n" in hlo_text else hlo_text
    parts = _NUM_PARTITIONS.search(head)
    replicas = _REPLICA_COUNT.search(head)
    devices = (int(parts.group(1)) if parts else 1) * (int(replicas.group(1)) if replicas else 1)
    return comps, entry, devices


def named_computation(attrs: str, key: str) -> str | None:
    """The computation an instruction's attribute ``key=%name`` names (a ``while``'s ``body``
    or ``condition``), or ``None``."""
    m = re.search(rf"\b{key}=%([\w.\-]+)", attrs)
    return m.group(1) if m else None


def callees(instr: Instruction) -> list[str]:
    """The computations ``instr`` calls: a fusion's, a call's, a reduction's, a branch's."""
    names = _CALLED.findall(instr.attrs)
    for group in _CALLED_LIST.findall(instr.attrs):
        names += re.findall(r"%([\w.\-]+)", group)
    return names


def collective_kind(comp: Computation, instr: Instruction) -> str | None:
    """The kind of :data:`KINDS` ``instr`` counts as where it stands, or ``None``: no collective,
    the ``done`` of an asynchronous pair (its start counts), or a TPU copy of a collective its
    start fusion counts. A TPU ``all-reduce`` in an ``all-reduce-scatter`` computation is the
    reduce-scatter it is; a DCN host transfer ``send``, the kind its transfer type names."""
    opcode = instr.opcode
    if opcode.endswith("-done"):
        return None
    if opcode == "send" and (m := _MEGASCALE.search(instr.attrs)) and m.group(1) in _MEGASCALE_KINDS:
        return _MEGASCALE_KINDS[m.group(1)]
    base = opcode.removesuffix("-start")
    kind = _OPCODES.get(base, base)
    if kind not in KINDS:
        return None
    if '"async_collective_fusion_config"' in instr.attrs and not _starts_async(comp):
        return None  # TPU: a copy of a collective its start fusion already counted
    if kind == "all-reduce" and comp.name.startswith("all-reduce-scatter"):
        return "reduce-scatter"  # TPU: all-reduce, then each device keeps its slice
    return kind


def _starts_async(comp: Computation) -> bool:
    return any(
        i.opcode == "custom-call" and 'custom_call_target="AsyncCollectiveStart"' in i.attrs for i in comp.instrs.values()
    )


def runs_collectives(hlo_text: str) -> bool:
    """Whether one run of a compiled module executes a collective (:func:`collective_kind`):
    in its entry computation or in what it runs, loop bodies and conditions and every branch of
    a ``conditional`` included."""
    comps, entry, _ = read_module(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text: pass compiled.as_text()")
    seen: set[str] = set()

    def runs(name: str, depth: int = 0) -> bool:
        comp = comps.get(name)
        if name in seen or comp is None or depth > 64:
            return False
        seen.add(name)
        for instr in comp.instrs.values():
            if collective_kind(comp, instr) is not None:
                return True
            if instr.opcode.endswith("-done") or instr.opcode == "async-update":
                continue  # they name the computation their start already called
            if instr.opcode == "while":
                inner = [named_computation(instr.attrs, key) or "" for key in ("body", "condition")]
            else:
                inner = callees(instr)
            if any(runs(callee, depth + 1) for callee in inner):
                return True
        return False

    return runs(entry)
