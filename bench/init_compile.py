"""Compile time of a sharded init against depth: layers vectorized vs created one by one.

    python bench/init_compile.py [--models gpt2-tiny,gpt2,gpt2-medium] [--mesh fsdp=8]

``nnxscale.compile_init`` of each model on a mesh of 8 simulated CPU devices (compiled
only, nothing allocated), twice in the same process:

  vectorized  ``nnxscale.stack_layers`` as shipped: one layer traced, ``jax.vmap`` over
              the layers, so each parameter is drawn once for the whole stack.
  one_by_one  the baseline: the layers created in a Python loop and stacked (what
              ``stack_layers`` did before 2026-11-24): every layer's draws are in the
              program.

Both give the same numbers (tests/test_pipeline.py checks it array by array). The
persistent compilation cache is off, so each figure is a real compilation. The last line
is JSON: per model ``[vectorized s, one_by_one s, ratio]``, ratio = vectorized / one_by_one.
"""

from __future__ import annotations

import argparse
import json
import os
import time

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import nnxscale  # noqa: E402
from nnxscale.layers import stack  # noqa: E402
from nnxscale.models import gpt2  # noqa: E402


def one_by_one(make_layer, n, rngs):
    graphdef, first = nnx.split(make_layer(rngs))
    states = [first] + [nnx.split(make_layer(rngs))[1] for _ in range(n - 1)]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def compile_seconds(name: str, mesh) -> float:
    cfg = gpt2.preset(name)
    rules = nnxscale.resolve(None, mesh, min_shard_bytes=0)
    start = time.perf_counter()
    nnxscale.compile_init(lambda: gpt2.GPT2(cfg, rngs=nnx.Rngs(0)), mesh, rules)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-tiny,gpt2,gpt2-medium")
    ap.add_argument("--mesh", default="fsdp=8")
    args = ap.parse_args()
    mesh = nnxscale.make_mesh(args.mesh)
    compile_seconds("gpt2-tiny", mesh)  # warm-up: imports and JAX's own first-use costs
    shipped = stack._create_stacked
    out = {}
    for name in args.models.split(","):
        layers = gpt2.preset(name).n_layer
        vectorized = compile_seconds(name, mesh)
        stack._create_stacked = one_by_one
        try:
            baseline = compile_seconds(name, mesh)
        finally:
            stack._create_stacked = shipped
        out[name] = [round(vectorized, 2), round(baseline, 2), round(vectorized / baseline, 3)]
        print(f"{name:12s} {layers:3d} layers on {args.mesh}: vectorized {vectorized:6.2f} s, "
              f"one by one {baseline:6.2f} s, ratio {vectorized / baseline:.3f}", flush=True)  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
