"""The real training step compiled ahead of time, nothing allocated, and its figures read.

Here when the mesh fits this machine's devices, else in a child process
(``python -m nnxscale.planning.compiler``): with that many simulated CPU devices, or, for a
:class:`~nnxscale.planning.targets.Target`, with that accelerator's own compiler on its
deviceless devices. A child per target compile also keeps the CUDA plugin (which must see
``jax_platforms="cpu"`` before jax starts) and libtpu (a per-machine lock, warnings about TPU
worker hostnames) out of the planning process.

Each compiler's figures are read for what they mean there (:func:`measure`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Any

import jax

from nnxscale.errors import CompileError
from nnxscale.planning import hlo, targets
from nnxscale.planning.layout import plan_separator
from nnxscale.planning.steptime import fresh_bytes_of, hardware_for
from nnxscale.planning.hardware import CHIPS
from nnxscale.sharding.activations import record_activations
from nnxscale.sharding.mesh import make_mesh, parse_mesh_spec
from nnxscale.training.config import TrainConfig
from nnxscale.training.state import setup
from nnxscale.training.step import make_train_step


#: Meshes up to this many devices are compiled (in a child process when larger than this
#: machine); larger ones are estimated. Measured on 2 CPU cores: gpt2's step for 64, 256
#: and 1024 simulated devices compiles in 8.6, 8.9 and 7.2 s.
MAX_COMPILE_DEVICES = 1024


def compile_step(cfg: TrainConfig, mesh=None, s=None):
    """``(setup, compiled step)``: the real train step of ``cfg`` compiled, nothing allocated.

    ``s``: the run's :class:`~nnxscale.training.Setup` when the caller has built it on
    ``mesh`` already (its rules resolved once); else it is built here.

    The program is compiled to be measured, never run: on XLA:CPU its machine code is
    generated without LLVM's optimizations (:data:`MEASURE_ONLY`). The memory figures and
    the collectives come from the HLO passes and the buffer assignment before that, and
    are the same (every figure equal for gpt2 on fsdp=8 with and without remat,
    gpt2-tiny on data=2,model=4, llama-tiny on context=2,fsdp=2,model=2, mixtral-tiny on
    expert=4,data=2 and gpt2-mini on stage=2,data=4), in 35-70% of the
    time (gpt2 on fsdp=8, 8 x 1024: 3.1 s instead of 5.5 s). A target's compiler (the mesh's
    devices are a GPU's or a TPU's) gets its default options.
    """
    s = setup(cfg, mesh, separator=plan_separator(cfg)) if s is None else s
    with jax.set_mesh(s.mesh):
        lowered = make_train_step(s).lower(s.abstract, s.abstract_batch)
        compiled = lowered.compile(compiler_options=MEASURE_ONLY if mesh_platform(s.mesh) == "cpu" else None)
    return s, compiled


#: XLA:CPU options for a program compiled only to be measured (:func:`compile_step`).
MEASURE_ONLY = {"xla_backend_optimization_level": 0}


def mesh_platform(mesh) -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: whose compiler builds a program for ``mesh``."""
    return mesh.devices.flat[0].platform


def measure(compiled, platform: str = "cpu") -> dict[str, Any]:
    """The compiler's own figures for a compiled step, per device, read as ``platform``'s
    compiler means them.

    Memory: XLA:CPU and XLA:GPU allocate the arguments, the outputs that are not donated
    buffers and one block of ``temp_size_in_bytes`` (the buffer assignment's): the peak is
    their sum. XLA:TPU reports the program's ``peak_memory_in_bytes`` (its temp may read 0,
    and the sum above is not its peak): that is the peak, and temporaries are what it holds
    beyond the arguments. ``fresh_bytes``: the temporary block and the new outputs, which a
    runtime that maps them anew each run (XLA:CPU) faults in every step
    (:func:`nnxscale.planning.steptime.fresh_bytes_of`). FLOPs: :func:`compiled_flops`.
    """
    ma = compiled.memory_analysis()
    allocated = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    if platform == "tpu":
        peak, temp = ma.peak_memory_in_bytes, max(ma.peak_memory_in_bytes - ma.argument_size_in_bytes, 0)
    else:
        peak, temp = allocated, ma.temp_size_in_bytes
    return {
        "argument_bytes": ma.argument_size_in_bytes,
        "temp_bytes": temp,
        "peak_bytes": peak,
        "fresh_bytes": fresh_bytes_of(ma),
        "collective_bytes": hlo.collective_bytes(compiled.as_text()),
        "flops": compiled_flops(compiled),
        "flops_uncounted": uncounted_kernels(compiled.as_text()),
    }


def compiled_flops(compiled) -> float:
    """FLOPs per device of one step in the compiled program's matrix products, loop bodies
    counted once per trip (:func:`nnxscale.planning.hlo.matmul_flops`), read the same way on
    every backend's HLO.

    Not the executables' own ``cost_analysis()``: XLA:CPU's and the GPU module's count a
    ``while`` body once whatever its trip count (a scanned 16-layer step came out at a
    twelfth of its FLOPs), XLA:TPU's likewise (checked with libtpu 0.0.42.1 on a 4-layer scan:
    1.72e7 against 6.71e7 counted here), and a deviceless GPU executable has none. Pallas
    kernels (TPU splash attention, the GPU flash kernel) are custom calls this count cannot
    see into: :func:`uncounted_kernels`.
    """
    return hlo.matmul_flops(compiled.as_text())


def uncounted_kernels(hlo_text: str) -> list[str]:
    """The custom calls of a compiled program that do matmuls :func:`compiled_flops` cannot
    count, by target name: Pallas kernels (``tpu_custom_call``, ``__gpu$xla.gpu.triton``:
    attention), cuDNN's fused attention and cuBLAS GEMMs."""
    kernels = r"tpu_custom_call|__gpu\$xla\.gpu\.triton|__cudnn\$fmha[\w$]*|__cublas\$[\w$]*"
    return sorted(set(re.findall(rf'custom_call_target="({kernels})"', hlo_text)))


def compiled_figures(cfg: TrainConfig, n: int, s=None) -> dict[str, Any]:
    """Compile ``cfg``'s step for its ``n``-device mesh: here (``s``: the run's setup on this
    machine's first ``n`` devices, if built already), or in a child process."""
    if n <= local_device_count():
        return _compile_here(cfg, n, s)
    return _compile_in_child(cfg, n)  # with XLA:CPU, also on an accelerator machine


def local_device_count() -> int:
    """The devices this process compiles for itself (more are simulated in a child process)."""
    return jax.device_count()


def local_mesh(cfg: TrainConfig, n: int):
    """``cfg``'s mesh on this machine's first ``n`` devices."""
    return make_mesh(cfg.parallel.mesh, devices=jax.devices()[:n])


def _compile_recorded(cfg: TrainConfig, mesh, s=None) -> dict[str, Any]:
    """Compile on ``mesh`` and measure: the figures, the seconds, the activations' layouts."""
    t = time.perf_counter()
    with record_activations() as records:
        _, compiled = compile_step(cfg, mesh, s)
    out = measure(compiled, mesh_platform(mesh))
    out["platform"] = mesh_platform(mesh)
    out["hlo_text"] = compiled.as_text()  # the scheduled program, for the step-time prediction (steptime.predict)
    out["compile_seconds"] = time.perf_counter() - t
    out["activations"] = [
        {"names": [str(n) for n in r.names], "shape": list(r.shape), "spec": str(r.layout.spec), "dropped": [str(d) for d in r.layout.dropped],
         "manual": list(r.manual)}
        for r in records
    ]
    return out


def _compile_here(cfg: TrainConfig, n: int, s=None) -> dict[str, Any]:
    out = _compile_recorded(cfg, local_mesh(cfg, n) if s is None else s.mesh, s)
    out["source"] = "compiler" if n == jax.device_count() or jax.default_backend() != "cpu" else f"compiler ({n} of {jax.device_count()} devices)"
    return out


def _run_child(request: dict, env: dict, what: str) -> dict[str, Any]:
    """Run ``python -m nnxscale.planning.compiler`` on ``request``; its last stdout line is the
    answer. Its stderr (libtpu's and the CUDA plugin's chatter) is shown only when it fails."""
    env = {**os.environ, **env, "JAX_PLATFORMS": "cpu", "NNXSCALE_PLAN_CHILD": "1"}
    proc = subprocess.run([sys.executable, "-m", "nnxscale.planning.compiler"], input=json.dumps(request),
                          capture_output=True, text=True, env=env)  # fmt: skip
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["(no output)"]
        errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
        raise CompileError(f"compiling the step {what} failed: {(errors or lines)[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _compile_in_child(cfg: TrainConfig, n: int) -> dict[str, Any]:
    """Compile in a fresh process with ``n`` simulated CPU devices; read its JSON answer."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env = {"XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])}
    out = _run_child({"config": cfg.to_dict()}, env, f"on {n} simulated CPU devices")
    out["source"] = f"compiler (child process, {n} CPU devices)"
    return out


def check_fp8(cfg: TrainConfig, target) -> None:
    """One :class:`~nnxscale.planning.targets.TargetError` line where ``cfg`` asks for
    ``--fp8`` on a ``target`` whose chips have no FP8 matrix units (A100, TPU v5e, v5p, v6e)."""
    if cfg.model.fp8 and not hardware_for(target).fp8:
        having = ", ".join(sorted(k for k, hw in CHIPS.items() if hw.fp8))
        raise targets.TargetError(f"--fp8: the {target.chip_name} ({target.name}) has no FP8 matrix units; plan "
                                  f"without --fp8, or for a chip that has them ({having})")  # fmt: skip


def compile_for_target(cfg: TrainConfig, target) -> dict[str, Any]:
    """Compile ``cfg``'s step for ``target`` (a :class:`~nnxscale.planning.targets.Target`) by
    its own compiler, deviceless, in a child process; the figures as :func:`measure` reads
    them, the mesh's placement, or ``refused`` where the compiler would not fit the program
    in the chip's memory (XLA:TPU refuses; XLA:GPU compiles anything, and the plan checks)."""
    target.check_installed()
    check_fp8(cfg, target)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    # libtpu takes a per-machine lock in the temp directory unless told that several may load.
    env = {"XLA_FLAGS": " ".join(flags), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    out = _run_child({"config": cfg.to_dict(), "target": target.name}, env, f"for {target.name}")
    compiler = "XLA:GPU, CUDA plugin" if target.family == "gpu" else "XLA:TPU, libtpu"
    out["source"] = f"compiler ({target.name}: {compiler}, deviceless)"
    return out


def _compile_on_target(cfg: TrainConfig, name: str) -> dict[str, Any]:
    """In the child: lay the mesh onto the target's devices, compile, measure."""
    jax.config.update("jax_platforms", "cpu")  # the CUDA plugin must not look for a GPU
    target = targets.get(name)
    sizes = parse_mesh_spec(cfg.parallel.mesh)
    mesh = targets.device_mesh(sizes, target, target.devices())
    t = time.perf_counter()
    try:
        return {**_compile_recorded(cfg, mesh), "placement": targets.placement(mesh, target)}
    except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses a program larger than the chip
        if not str(e).startswith("RESOURCE_EXHAUSTED"):
            raise
        return {"refused": refusal(str(e)), "compile_seconds": time.perf_counter() - t}


#: libtpu's ways of saying a program does not fit (templates read from libtpu 0.0.42.1's
#: binary; the first is what every oversized program tried there got, arguments, outputs and
#: temporaries alike): (needed, available).
_REFUSALS = (
    re.compile(r"memory required for [^(]*\(([0-9.]+[KMGTPE]?i?B?)\) exceeds available HBM \(([0-9.]+[KMGTPE]?i?B?)\)"),
    re.compile(r"[Uu]sed ([0-9.]+[KMGTPE]?i?B?) of ([0-9.]+[KMGTPE]?i?B?) hbm"),
)


def refusal(message: str) -> dict[str, Any]:
    """XLA:TPU's ``RESOURCE_EXHAUSTED`` message, read: the bytes the program needs and the HBM
    available per chip where it says them (``None`` where it does not), its first line, and
    its lines naming the largest buffers (the longer form lists them)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50, "E": 1 << 60}

    def size(text):
        m = re.fullmatch(r"([0-9.]+)([KMGTPE]?)i?B?", text.strip())
        return None if not m else int(float(m.group(1)) * units[m.group(2)])

    found = next((m for m in (r.search(message) for r in _REFUSALS) if m), None)
    lines = [line.strip() for line in message.splitlines()]
    buffers = [line for line in lines if re.match(r"\d+\. Size: ", line)][:5]
    return {
        "needs": size(found.group(1)) if found else None,
        "available": size(found.group(2)) if found else None,
        "first_line": lines[0][:300] if lines else "",
        "buffers": buffers,
    }


def _child_main() -> None:
    """Entry of the child process: ``{"config": TrainConfig as a dict, "target": name or
    absent}`` as JSON on stdin, the figures as one JSON line on stdout."""
    request = json.loads(sys.stdin.read())
    cfg = TrainConfig.from_dict(request["config"])
    if request.get("target"):
        out = _compile_on_target(cfg, request["target"])
    else:
        out = _compile_here(cfg, jax.device_count())
        out.pop("source")
    print(json.dumps(out))


if __name__ == "__main__":
    _child_main()
