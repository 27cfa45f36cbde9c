"""Every test runs on 8 simulated CPU devices: the flag must be set before jax is imported.

``text_data``, the small real-text corpus the training tests share, is defined here.
"""

import argparse
import dataclasses
import functools
import inspect
import os
import typing

import pytest

# LLVM at -O0 for the suite and the processes it starts: the tiny test models spend most of
# their time compiling. The whole suite from a cold cache took 5 min 15 s at -O0 and 6 min 08 s
# at -O1 (8.9 and 10.8 min of CPU; 2 cores, jaxlib 0.10.2, 2026-11-24): backend compiles of
# the tests' programs took 163 s instead of 308; the runs of many steps got slower, by less
# than that. XLA:CPU's loop-fusion emitters off: gpt2-tiny's training step compiled in 2.2-2.5 s
# instead of 3.5-3.7 s and ran as fast. No fast-math either way; the last bits of a result
# may differ from the defaults', and the suite only compares runs made under the same flags,
# or to a tolerance. (Eigen's thread pool off, --xla_cpu_multi_thread_eigen=false, was tried
# on 2026-11-25 and gains nothing on an idle machine: tests/test_train.py cold 97 s against
# 92 s on jaxlib 0.10.2, 108 s against 106 s on 0.12.0.1.)
#
# These are speed flags, and a jaxlib that does not know one aborts the process at its first
# device query (jaxlib 0.12 dropped --xla_cpu_use_fusion_emitters; pytest's capture then
# swallowed the abort and the suite exited 1 with no word). So a child process starts the
# backend with all of them, and again without each one its abort names unknown (jaxlib 0.10:
# one probe; 0.12: two); the verdict travels to the workers and to the processes the tests
# start in the environment.
DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
SPEED_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_VERDICT = "NNXSCALE_TEST_XLA_FLAGS"


def _backend_starts(flags: str) -> tuple[bool, str]:
    """Whether jax's CPU backend starts under ``XLA_FLAGS=flags``, and what it printed if not."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True)
    return probe.returncode == 0, probe.stderr.strip()[-2000:]


def _suite_xla_flags() -> str:
    if _VERDICT in os.environ:  # decided by the pytest process that started this one
        return os.environ[_VERDICT]
    base = (os.environ.get("XLA_FLAGS", "") + " " + DEVICES_FLAG).strip()
    kept = list(SPEED_FLAGS)
    while True:  # one probe where the jaxlib knows them all; one more per flag it names unknown
        ok, why = _backend_starts(" ".join([base, *kept]))
        if ok:
            break
        unknown = [flag for flag in kept if f"Unknown flag in XLA_FLAGS: {flag.split('=')[0]}" in why]
        if not unknown:
            raise pytest.UsageError(f"jax's CPU backend does not start with XLA_FLAGS={' '.join([base, *kept])!r}:\n{why}")
        kept.remove(unknown[0])
    os.environ[_VERDICT] = " ".join([base, *kept])
    return os.environ[_VERDICT]


os.environ["XLA_FLAGS"] = _suite_xla_flags()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the suite and the processes it starts, under the
# project's ignored build folder: identical programs compile once per cache (a cold CI run
# still shares them across tests). The processes of a multi-process CPU job compile
# everything themselves (nnxscale.jobs.distributed explains why).
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "jax-test-cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# nnxscale's own per-machine cache (XLA:CPU's calibrated figures, nnxscale.planning.calibration)
# under the same ignored build folder: the suite never writes to the user's home.
os.environ["XDG_CACHE_HOME"] = os.path.join(os.path.dirname(_CACHE), "xdg-cache")
# Defined before any thread starts; each test then sets it (pytest_runtest_setup below).
os.environ["NNXSCALE_STEP_XLA_OPTIONS"] = ""

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 simulated CPU devices"


@pytest.hookimpl(trylast=True)  # after pytest's own hook is installed: this one wraps it
def pytest_configure(config):
    """Orbax's abandoned reads of a damaged checkpoint end later, in tensorstore's threads,
    where each done-callback raises "Event loop is closed" into the loop its failed restore
    closed, through ``sys.unraisablehook`` (the tests of damaged checkpoints: 23 in one cold
    run, some after their test had ended). The command drops these echoes itself
    (``checkpointer._QuietOrbaxErrors``); a library call leaves them to the process, here
    pytest's hook, which formats each one in that foreign thread and warns of it. The suite
    drops exactly these before pytest's hook sees them; every other unraisable exception
    still reaches it. (This was first taken for the cause of a worker's segmentation fault
    on Python 3.13.0; a worker crashed again with it in place: tests/test_docs.py's
    ``fresh_process_state`` tells the likely cause.)"""
    import sys

    from nnxscale.checkpoint.checkpointer import closed_loop_echo

    inner = sys.unraisablehook

    def hook(info):
        if not closed_loop_echo(info.exc_value):
            inner(info)

    sys.unraisablehook = hook


# The tests marked ``extended`` assert again, on further meshes, models, schedules and
# moments, a property that a test of the suite asserts on its own configuration (the suite
# keeps at least one test of every property). ``pytest`` leaves them out; ``pytest -m
# extended`` runs them alone, and CI (.ci/run) runs them after each stack's suite. The reason
# is the suite's time on 2 cores (issue 30): measured per test at dced8ac, they took 29% of the
# whole suite's CPU seconds (354 of 1,225 on jax 0.10.2, 540 of 1,857 on 0.12.0.1).
EXTENDED_HELP = 'pytest -m extended runs them, pytest -m "extended or not extended" runs everything'


def _select_extended(config, items) -> None:
    """Without ``-m``, the ``extended`` tests are deselected."""
    if config.option.markexpr:
        return
    keep, extended = [], []
    for item in items:
        (extended if item.get_closest_marker("extended") else keep).append(item)
    if extended:
        config.hook.pytest_deselected(items=extended)
        items[:] = keep


def pytest_report_header(config):
    """The first lines of the report (pytest-xdist's controller prints them too, though its
    workers collect and deselect)."""
    if not config.option.markexpr:
        return f"tests marked extended (further meshes, models and moments of the suite's properties) are left out: {EXTENDED_HELP}"


def pytest_collection_modifyitems(config, items):
    """Leaves out the ``extended`` tests unless ``-m`` says otherwise; skips the tests marked
    ``needs_cuda_plugin`` without the CUDA plugin: they compile for NVIDIA targets
    (``pip install -e '.[cuda13]'``; .ci/run installs it and runs them after the suite)."""
    from nnxscale.sharding.devices import installed_extra

    _select_extended(config, items)

    if installed_extra("gpu") is not None:
        return
    skip = pytest.mark.skip(reason="the NVIDIA compiler is not installed: pip install -e '.[cuda13]'")
    for item in items:
        if "needs_cuda_plugin" in item.keywords:
            item.add_marker(skip)


# The train step of a test marked ``many_steps`` is compiled at LLVM -O1, every other program
# at -O0 (NNXSCALE_STEP_XLA_OPTIONS: nnxscale.training.step). At -O0 nothing is vectorized and
# the step's elementwise work (the optimizer update, the non-finite guard's selects) is
# slow; -O1 costs more to compile. Measured 2026-11-26 (CPU seconds, data=8, batch 16 x 32,
# cold cache, a loaded 2-core machine): llama-mini's 20 steps 30 s at -O0 and 7 s at -O1 for
# about 4 s more compiling; gpt2-tiny's 20 steps 3.6 s and 0.9 s for 3.5 s more compiling:
# the mark pays where a test runs many steps of few programs, and only there: measured per
# test (CPU seconds, before -> after), the 20-step 1F1B run 87 -> 64; the 20-step LoRA test
# over 6 programs 109 -> 117 and the Mixtral one over 4 (experts, a pipeline) 63 -> 74, so
# those two are not marked: their -O1 compiles cost more than their steps gain. A
# test's runs are all compiled one way (its comparisons never mix them); the variable
# travels to the processes it starts. Like the flags above, the options are used only where
# this jaxlib compiles a program with them (a speed option, never a failing test).
STEP_XLA_OPTIONS = '{"xla_backend_optimization_level": 1}'


@functools.cache
def _step_options_compile() -> bool:
    import json

    try:
        jax.jit(lambda x: x + 1, compiler_options=json.loads(STEP_XLA_OPTIONS)).lower(1.0).compile()
    except jax.errors.JaxRuntimeError:
        return False
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: the step options of its mark (see STEP_XLA_OPTIONS)."""
    from nnxscale.training.step import ENV_STEP_XLA_OPTIONS

    # Set, never added or removed while XLA's threads run (tests/test_docs.py's
    # fresh_process_state says why); empty is unset to nnxscale.
    if item.get_closest_marker("many_steps") and _step_options_compile():
        os.environ[ENV_STEP_XLA_OPTIONS] = STEP_XLA_OPTIONS
    else:
        os.environ[ENV_STEP_XLA_OPTIONS] = ""


@pytest.fixture
def devices():
    return jax.devices()


@pytest.fixture(scope="session")
def text_data(tmp_path_factory):
    """~280 KB of real text: a few standard-library modules' source."""
    parts = [inspect.getsource(m) for m in (argparse, dataclasses, inspect, typing)]
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n".join(parts))
    assert path.stat().st_size > 200_000
    return path


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory, text_data):
    """A byte-level BPE ``tokenizer.json`` of 512 tokens trained here on ``text_data`` with the
    ``tokenizers`` trainer (GPT-2's design: ByteLevel pre-tokenizer and decoder, an
    ``<|endoftext|>`` token), and a ``tokenizer_config.json`` naming it; nothing downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train([str(text_data)], trainer)
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}\n')
    return directory / "tokenizer.json"


@pytest.fixture
def rules_built(monkeypatch):
    """The mesh rules each :class:`~nnxscale.MeshRules` built while the test runs was resolved for
    (``{axis: size}``, in order): a run resolves its rules once, at setup, and passes them on."""
    from nnxscale.sharding.rules import MeshRules

    built = []
    original = MeshRules.__init__

    def counted(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(dict(self.sizes))

    monkeypatch.setattr(MeshRules, "__init__", counted)
    return built
