"""The public API: what ``nnxscale/__init__.py`` names, reachable as attributes, loaded lazily.

Each check runs in a fresh interpreter, where nothing has imported a submodule yet: in this
test process the other tests have imported them all, which would hide a name reachable only
by accident.
"""

import ast
import importlib
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import nnxscale


def fresh(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_import_nnxscale_does_not_import_jax():
    fresh("import sys, nnxscale; assert 'jax' not in sys.modules, 'jax imported'")


def test_every_public_name_and_submodule_is_an_attribute_of_a_fresh_import():
    fresh(
        "import nnxscale, types\n"
        "for name in nnxscale.__all__:\n"
        "    assert getattr(nnxscale, name) is not None, name\n"
        "for name in nnxscale._SUBMODULES:\n"
        "    assert isinstance(getattr(nnxscale, name), types.ModuleType), name\n"
    )


def test_train_is_the_function_whatever_was_imported_before():
    # Before: after `from nnxscale.train import setup`, nnxscale.train was the module.
    fresh(
        "from nnxscale import setup\n"
        "import nnxscale, nnxscale.training.loop\n"
        "assert callable(nnxscale.train) and nnxscale.train.__name__ == 'train', nnxscale.train\n"
    )


def test_the_tree_is_packages_with_an_api_each():
    """Top level: the packages of ``_SUBMODULES`` (each a folder with a docstring and an
    ``__all__`` whose every name resolves) and ``__main__``; no export shadows a module,
    and no module is named both ways."""
    modules = {m.name for m in pkgutil.iter_modules(nnxscale.__path__)}
    assert modules == set(nnxscale._SUBMODULES) | {"__main__"}
    assert not set(nnxscale._EXPORTS) & modules  # an export shadowing a module, or the reverse
    for name in nnxscale._SUBMODULES:
        package = importlib.import_module(f"nnxscale.{name}")
        assert (package.__doc__ or "").strip(), f"nnxscale.{name} has no docstring"
        if hasattr(package, "__path__"):
            assert package.__all__, name
            for public in package.__all__:
                assert getattr(package, public) is not None, f"nnxscale.{name}.{public}"
            inner = {m.name for m in pkgutil.iter_modules(package.__path__)}
            assert not any(m.startswith("_") for m in inner), f"nnxscale.{name}: one naming rule, no _module inside a package"
    for name in nnxscale.__all__:
        value = getattr(nnxscale, name)
        assert isinstance(value, types.ModuleType) == (name in nnxscale._SUBMODULES), name


def module_imports() -> dict[str, set[str]]:
    """``{module: nnxscale modules it imports at module level}`` read from the source; a
    package's ``__init__`` counts as the package, and importing ``a.b`` imports ``a`` first."""
    root = Path(nnxscale.__file__).parent
    graph = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found = set()
        for node in ast.parse(path.read_text()).body:  # module level only: imports inside functions run on use
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nnxscale"):
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("nnxscale")]
            for target in targets:
                pieces = target.split(".")
                found.update(".".join(pieces[:i]) for i in range(2, len(pieces) + 1))
        graph[name] = found
    return {m: {d for d in deps if d in graph and d != m and not m.startswith(d + ".")} for m, deps in graph.items()}


def test_no_import_cycle():
    graph = module_imports()
    assert len(graph) > 40
    state = {}

    def visit(module, trail):
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", "import cycle: " + " -> ".join(trail[trail.index(module):] + [module])
        state[module] = "open"
        for dep in sorted(graph[module]):
            visit(dep, trail + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])


def test_library_errors_share_one_base_class():
    for name in ("MeshError", "LayoutError", "RulesError", "ConfigError", "ModelError", "DataError",
                 "CheckpointError", "DamagedCheckpointError", "JobError"):  # fmt: skip
        assert issubclass(getattr(nnxscale, name), nnxscale.NnxscaleError), name
