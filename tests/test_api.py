"""The public API: what ``nnxscale/__init__.py`` names, reachable as attributes, loaded lazily.

Each check runs in a fresh interpreter, where nothing has imported a submodule yet: in this
test process the other tests have imported them all, which would hide a name reachable only
by accident.
"""

import pkgutil
import subprocess
import sys
import types

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
        "import nnxscale, nnxscale._train\n"
        "assert callable(nnxscale.train) and nnxscale.train.__name__ == 'train', nnxscale.train\n"
    )


def test_no_name_is_both_a_module_and_something_else():
    modules = {m.name for m in pkgutil.iter_modules(nnxscale.__path__)}
    private = {m for m in modules if m.startswith("_")}
    public = modules - private
    assert public == set(nnxscale._SUBMODULES), "a module that is neither private nor a public submodule"
    assert not set(nnxscale._EXPORTS) & modules  # an export shadowing a module, or the reverse
    for name in nnxscale.__all__:
        value = getattr(nnxscale, name)
        assert isinstance(value, types.ModuleType) == (name in nnxscale._SUBMODULES), name
    for name, module in nnxscale._EXPORTS.items():
        assert module.rsplit(".", 1)[-1].startswith("_") or module.rsplit(".", 1)[-1] in nnxscale._SUBMODULES, name


def test_library_errors_share_one_base_class():
    for name in ("MeshError", "LayoutError", "RulesError", "ConfigError", "ModelError", "DataError",
                 "CheckpointError", "DamagedCheckpointError", "JobError"):  # fmt: skip
        assert issubclass(getattr(nnxscale, name), nnxscale.NnxscaleError), name
