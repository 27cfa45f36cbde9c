"""What one training step's compiled program moves and needs, on a real target's compiler.

Compiles the real train step (``make_train_step``) for XLA:CPU (8 simulated devices), for
NVIDIA H100s deviceless (``h100x8``; needs jax-cuda12-plugin and jax-cuda12-pjrt) or for a
TPU deviceless (``v5p-8``, ``v5p-16``, ``v5e-8``...; needs ``jax[tpu]``), and prints one JSON
line: the collectives counted op by op (``bench/_collectives.py``: async pairs once, loop
trip counts), the three largest reductions with how often each runs, the memory figure of
that compiler, FLOPs where it reports them, and the ratio of the reductions to the FSDP
arithmetic (the gradient reduced once per step, in the dtype the compiler chose for each).

    python bench/step_waste.py --model llama-3.2-1b --mesh fsdp=8 --batch-size 8 --seq-len 4096 \\
        --dtype bfloat16 --remat full --target h100x8

Runs against whichever nnxscale its Python imports, so the same command with another
checkout's virtual environment gives the before and after of a change. TPU and GPU compiles
take seconds to minutes and gigabytes: run one at a time (``flock /tmp/nnxscale-heavy.lock``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

#: Some TPU names (any name of ``nnxscale plan --list-targets`` works).
TPUS = ("v5p-8", "v5p-16", "v5p-32", "v5p-64", "v5e-4", "v5e-8", "v5e-16")


def target_devices(target: str):
    """This machine's devices for ``cpu``, else the target's (the planner's catalog), deviceless."""
    import jax

    from nnxscale.planning import targets

    if target == "cpu":
        return jax.devices()
    return targets.get(target).devices()


def compile_step(cfg, target: str):
    """``(setup, compiled train step, seconds)`` of ``cfg`` on ``target``'s compiler."""
    import jax

    import nnxscale
    from nnxscale.planning.compiler import compile_step as compile_for_plan

    jax.config.update("jax_platforms", "cpu")
    mesh = nnxscale.make_mesh(cfg.parallel.mesh, devices=target_devices(target))
    t0 = time.perf_counter()
    s, compiled = compile_for_plan(cfg, mesh)
    return s, compiled, time.perf_counter() - t0


def figures(compiled, params: int) -> dict:
    """Memory (the compiler's peak where it reports one), collectives op by op, FLOPs, for a
    model of ``params`` parameters."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _collectives import matmul_flops, ops

    text = compiled.as_text()
    found = ops(text)
    kinds: dict[str, float] = {}
    for kind, nbytes, n in found:
        kinds[kind] = kinds.get(kind, 0) + nbytes * n
    reductions = sorted(((nbytes * n, kind, nbytes, n) for kind, nbytes, n in found if kind in ("reduce-scatter", "all-reduce")),
                        reverse=True)  # fmt: skip
    ma = compiled.memory_analysis()
    peak = getattr(ma, "peak_memory_in_bytes", 0) or (
        ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    reduced = kinds.get("reduce-scatter", 0) + kinds.get("all-reduce", 0)
    return {
        "memory_MB": round(peak / 1e6, 1), "temp_MB": round(ma.temp_size_in_bytes / 1e6, 1),
        "collectives_MB": {k: round(v / 1e6, 1) for k, v in sorted(kinds.items())},
        "largest_reductions": [f"{kind} {nbytes / 1e6:.1f} MB x {n}" for _, kind, nbytes, n in reductions[:3]],
        "params": params, "reduced_over_f32_gradient": round(reduced / (4 * params), 3),
        "flops": (cost or {}).get("flops"),  # the compiler's cost_analysis (a loop body once)
        "matmul_flops": matmul_flops(text),  # matrix products, each loop body once per trip
    }  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="cpu", help="cpu, h100x8, " + ", ".join(TPUS))
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--mesh", default="fsdp=8")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--remat", default="full")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--hlo", help="also write the compiled program's text here")
    a = p.parse_args(argv)
    if a.target == "cpu":
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    else:
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax

    import nnxscale
    from nnxscale.training.config import TrainConfig

    cfg = TrainConfig.from_flags(model=a.model, mesh=a.mesh, batch_size=a.batch_size, seq_len=a.seq_len, dtype=a.dtype,
                                 remat=a.remat, grad_accum=a.grad_accum, microbatches=a.microbatches)  # fmt: skip
    s, compiled, seconds = compile_step(cfg, a.target)
    params = sum(x.size for x in jax.tree.leaves(s.abstract["params"]))
    if a.hlo:
        with open(a.hlo, "w") as f:
            f.write(compiled.as_text())
    print(json.dumps({"target": a.target, "model": a.model, "mesh": a.mesh, "batch": [a.batch_size, a.seq_len],
                      "dtype": a.dtype, "remat": a.remat, "grad_accum": a.grad_accum, "microbatches": a.microbatches,
                      "nnxscale": nnxscale.__file__, "compile_s": round(seconds, 1), **figures(compiled, params)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
