"""The package's shape, read from its source with ``ast`` (nothing imported): imports run one
way up the floors and in no cycle, no function is long beyond what a reader holds, no module
imports another's private names, and the code carries no dated history."""

import ast
import pathlib
import re

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "nnxscale"

#: Packages bottom to top: a module imports its own package's modules and lower floors only.
#: ``teaching`` (the single-device simulations) stands beside them on ``sharding``.
FLOORS = ["errors", "progress", "jobs", "sharding", "data", "layers", "models", "checkpoint", "training", "planning",
          "cli"]  # fmt: skip
BESIDE = {"teaching": "sharding", "__main__": "cli"}
#: Lines a function may have, and how many may have more than SOFT_LINES.
MAX_LINES, SOFT_LINES, SOFT_ALLOWED = 120, 80, 3


def _modules() -> dict[str, tuple[pathlib.Path, ast.Module]]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (path, ast.parse(path.read_text()))
    return out


MODULES = _modules()


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _floor(package: str) -> int:
    return FLOORS.index(BESIDE.get(package, package)) if BESIDE.get(package, package) in FLOORS else -1


def _imports(tree: ast.Module):
    """``(imported module, names, line)`` of every nnxscale import, module level or not."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nnxscale"):
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("nnxscale"):
                    yield a.name, [], node.lineno


def _targets(module: str, names: list[str]) -> list[str]:
    """The modules an import reaches: the module, and those of its names that are modules."""
    return [module] + [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]


def test_imports_never_climb_the_floors():
    climbing = []
    for name, (path, tree) in MODULES.items():
        here = _package(name)
        for module, names, line in _imports(tree):
            there = _package(module)
            if there and here and there != here and _floor(there) > _floor(here):
                climbing.append(f"{path.relative_to(SRC.parent)}:{line} imports {module} ({here} is below {there})")
    assert not climbing, "\n".join(climbing)


def test_no_import_cycle_between_modules():
    graph = {name: {t for m, names, _ in _imports(tree) for t in _targets(m, names) if t in MODULES and t != name}
             for name, (_, tree) in MODULES.items()}  # fmt: skip
    # A package's __init__ that re-exports its modules lazily is not a cycle: only modules count.
    packages = {name for name, (path, _) in MODULES.items() if path.name == "__init__.py"}
    graph = {a: {b for b in bs if b not in packages} for a, bs in graph.items() if a not in packages}
    seen, on_path, cycles = set(), [], []

    def visit(node):
        if node in on_path:
            cycles.append(on_path[on_path.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        on_path.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        on_path.pop()

    for node in sorted(graph):
        visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _functions():
    for name, (path, tree) in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(SRC.parent)}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1


def test_no_function_is_longer_than_a_reader_holds():
    lengths = dict(_functions())
    too_long = {f: n for f, n in lengths.items() if n > MAX_LINES}
    long = {f: n for f, n in lengths.items() if n > SOFT_LINES}
    assert not too_long, f"over {MAX_LINES} lines: {too_long}"
    assert len(long) <= SOFT_ALLOWED, f"more than {SOFT_ALLOWED} functions over {SOFT_LINES} lines: {long}"


def test_no_module_imports_another_modules_private_names():
    private = []
    for name, (path, tree) in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nnxscale"):
                # the root's lazy loader is the packages' shared machinery (nnxscale/__init__.py)
                taken = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
                         and not (node.module == "nnxscale" and a.name == "_lazy")]  # fmt: skip
                if taken and node.module != name:
                    private.append(f"{path.relative_to(SRC.parent)}:{node.lineno} {node.module}: {taken}")
    assert not private, "\n".join(private)


@pytest.mark.parametrize("pattern", [r"\b20\d\d-\d\d-\d\d\b"], ids=["dates"])
def test_the_code_carries_no_dated_history(pattern):
    """History belongs in git and, where users need it, in docs/ with its date."""
    found = [f"{path.relative_to(SRC.parent)}:{i}: {line.strip()}"
             for path, _ in MODULES.values() for i, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(pattern, line)]  # fmt: skip
    assert not found, "\n".join(found)
