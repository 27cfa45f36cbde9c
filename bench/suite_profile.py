"""Where the test suite's CPU goes: per test, and per XLA compile (issue 30).

A pytest plugin and its summary. As a plugin it records, for every test, its CPU seconds
(the worker's and the processes it started) and every backend compile it caused (the
program's name and the CPU seconds of compiling it; persistent-cache hits compile nothing)::

    rm -rf build/jax-test-cache
    SUITE_PROFILE=/tmp/suite.jsonl PYTHONPATH=bench .venv/bin/pytest -p suite_profile
    python bench/suite_profile.py /tmp/suite.jsonl     # the summary below

On 2026-11-26, Python 3.13 and jax 0.12.0.1, a fresh clone at 9e38abb, an idle 2-core
machine: 1,518 CPU seconds over 780 tests, of which 752 compiling (1,942 compiles), 425 of
them 89 training steps (``jit_step``, 4.8 s each).
"""

import collections
import json
import os
import resource
import sys
import time

import pytest


def _cpu(who) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


class _Recorder:
    def __init__(self):
        self.compiles = None  # the current test's [name, cpu seconds]
        self.patched = False

    def patch(self):
        """Wrap JAX's backend compile (the one call every compile goes through) once."""
        from jax._src import compiler
        from jax._src.lib.mlir import ir

        real = compiler.backend_compile_and_load

        def compile_and_record(backend, module, *args, **kwargs):
            name = ir.StringAttr(module.operation.attributes["sym_name"]).value
            before = _cpu(resource.RUSAGE_SELF)
            try:
                return real(backend, module, *args, **kwargs)
            finally:
                if self.compiles is not None:
                    self.compiles.append([name, round(_cpu(resource.RUSAGE_SELF) - before, 3)])

        compiler.backend_compile_and_load = compile_and_record
        self.patched = True


_recorder = _Recorder()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _recorder.patched:
        _recorder.patch()
    self0, children0, t0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.time()
    _recorder.compiles = []
    yield
    record = {
        "id": item.nodeid,
        "wall": round(time.time() - t0, 3),
        "cpu_self": round(_cpu(resource.RUSAGE_SELF) - self0, 3),
        "cpu_children": round(_cpu(resource.RUSAGE_CHILDREN) - children0, 3),
        "compiles": _recorder.compiles,
    }
    _recorder.compiles = None
    with open(os.environ["SUITE_PROFILE"], "a") as f:
        f.write(json.dumps(record) + "\n")


def summarize(path: str, top: int = 15) -> None:
    tests = [json.loads(line) for line in open(path)]
    cpu = sum(t["cpu_self"] + t["cpu_children"] for t in tests)
    compiles = [c for t in tests for c in t["compiles"]]
    compile_cpu = sum(c[1] for c in compiles)  # [name, cpu seconds, ...]
    print(f"{len(tests)} tests, {cpu:,.0f} CPU s; {len(compiles)} compiles, {compile_cpu:,.0f} CPU s "
          f"({compile_cpu / cpu:.0%}); children {sum(t['cpu_children'] for t in tests):,.0f} CPU s")
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, seconds, *_ in compiles:
        by_name[name][0] += 1
        by_name[name][1] += seconds
    print("\nprograms by compile CPU (count, seconds):")
    for name, (n, seconds) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {seconds:7.1f}  {n:5d}  {name}")
    by_file = collections.defaultdict(lambda: [0.0, 0.0])
    for t in tests:
        f = t["id"].split("::")[0]
        by_file[f][0] += t["cpu_self"] + t["cpu_children"]
        by_file[f][1] += sum(c[1] for c in t["compiles"])
    print("\nfiles by CPU (seconds, of which compiling):")
    for f, (seconds, comp) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {seconds:7.1f}  {comp:7.1f}  {f}")


if __name__ == "__main__":
    summarize(sys.argv[1])
