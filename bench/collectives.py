"""Collectives of nnxscale's training step as a real accelerator's compiler builds them.

Compiles the step of one configuration (``planning.compiler.compile_step``) deviceless for
XLA:CPU (8 simulated devices), one node of 8 NVIDIA H100s or a TPU v5e-8, with the
targets of ``tests/data/hlo/make_fixtures.py``, and prints per device per step:

- the bytes by kind as ``nnxscale.planning.hlo`` counts them, beside an independent
  op-by-op count of the same program (``make_fixtures.count_by_results``): ratio 1.000;
- the FSDP arithmetic for the parameters (each weight gathered in the forward and again in
  the backward, its gradient reduce-scattered once; bytes in the compute dtype and in
  float32, the compiler picks);
- the largest collectives with the JAX operation each comes from, so that a collective the
  arithmetic does not predict can be named.

    python bench/collectives.py --backend h100 --model llama-3.2-1b --mesh fsdp=8 \\
        --batch-size 8 --seq-len 4096 --dtype bfloat16 --remat full

A GPU or TPU compile needs ``jax-cuda12-plugin``/``jax-cuda12-pjrt`` or ``jax[tpu]``;
run it under ``flock`` with ``nice`` on a shared machine (a 1B model's step takes about a
minute and several GB).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "data" / "hlo" / "make_fixtures.py"


def _fixtures():
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("cpu", "h100", "tpu"), default="h100")
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--mesh", default="fsdp=8")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--top", type=int, default=12, help="list this many of the largest collectives")
    ap.add_argument("--save-hlo", help="also write the compiled program's text here")
    args = ap.parse_args()
    if args.backend == "cpu" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

    import jax

    jax.config.update("jax_platforms", "cpu")
    import nnxscale
    from nnxscale.planning import hlo
    from nnxscale.planning.compiler import compile_step

    fx = _fixtures()
    flags = dict(model=args.model, mesh=args.mesh, batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype,
                 remat=args.remat)  # fmt: skip
    cfg = nnxscale.TrainConfig.from_flags(**flags)
    devices = list(fx.devices(args.backend))
    t = time.perf_counter()
    s, compiled = compile_step(cfg, nnxscale.make_mesh(args.mesh, devices=devices))
    seconds = time.perf_counter() - t
    text = compiled.as_text()
    if args.save_hlo:
        Path(args.save_hlo).write_text(text)

    ops = hlo.collectives(text)
    counted = hlo.collective_bytes(ops)
    independent = fx.count_by_results(text)
    params = s.num_params
    print(f"{args.model} on {args.backend} (mesh {args.mesh}, {args.batch_size} x {args.seq_len}, {args.dtype}, "
          f"remat {args.remat}): compiled in {seconds:.1f} s")  # fmt: skip
    print(f"{'kind':<20} {'counted GB':>11} {'op by op GB':>12} {'ratio':>6}")
    for kind in hlo.KINDS:
        if counted[kind] or independent[kind]:
            ratio = counted[kind] / independent[kind] if independent[kind] else float("nan")
            print(f"{kind:<20} {counted[kind] / 1e9:>11.3f} {independent[kind] / 1e9:>12.3f} {ratio:>6.3f}")
    loops = sum(not op.trips_known for op in ops)
    print(f"collectives in loops whose trip count could not be read: {loops}")
    print(f"FSDP arithmetic for {params:,} parameters: gathers 2 x params = {2 * params * 2 / 1e9:.2f} GB in bf16 "
          f"({2 * params * 4 / 1e9:.2f} in f32); gradient reduce-scatter 1 x = {params * 2 / 1e9:.2f} GB in bf16 "
          f"({params * 4 / 1e9:.2f} in f32)")  # fmt: skip

    by_source = collections.defaultdict(lambda: [0, 0, set(), set()])
    for op in ops:
        row = by_source[(op.kind, op.source or op.name)]
        row[0] += op.total_bytes
        row[1] += op.executions
        row[2].add(op.dtype)
        row[3].add(tuple(op.shapes[0]) if op.shapes else ())
    print("largest collectives (kind, GB per step, executions, dtype, first shape, JAX source):")
    for (kind, source), (nbytes, runs, dtypes, shapes) in sorted(by_source.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"  {kind:<15} {nbytes / 1e9:8.3f} x{runs:<4} {'+'.join(sorted(dtypes)):<9} {str(sorted(shapes)[0]):<22} {source[-90:]}")
    print(json.dumps({"counted": counted, "op_by_op": independent, "params": params, "compile_seconds": round(seconds, 1)}))


if __name__ == "__main__":
    sys.exit(main())
