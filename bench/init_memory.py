"""Per-device peak memory of sharded init: nnxscale vs Flax's default eager sharding.

    python bench/init_memory.py

A model of 4 x nnx.Linear(4096, 16384) in float32 (1 GiB of parameters), kernels split
over the 8 devices of a simulated CPU mesh. Both programs are compiled only, never run:
the figures come from XLA's own ``memory_analysis()`` of the init program.

  nnxscale      ``nnxscale.compile_init`` on ``nnxscale.make_mesh("model=8")`` (Auto axes),
                kernels annotated with ``nnxscale.logical(init, "embed", "mlp")``.
  flax_default  the model built inside ``jax.jit`` under ``jax.set_mesh`` of a default
                ``jax.make_mesh((8,), ("model",))`` (Explicit axes), kernels annotated with
                ``nnx.with_partitioning(init, (None, "model"))``.

nnxscale creates the model in groups of Variables (one compiled program each, see
``nnxscale.compile_init``); its per-device peak is the largest of (outputs of the
earlier groups + one group's temp + output). Flax's is its one program's temp + output.
Shard bytes = the bytes of the sharded
state one device holds (from the compiled program's output shardings). The last line is
JSON: ``{"nnxscale": ratio, "flax_default": ratio}`` with ratio = peak / shard bytes.
"""

from __future__ import annotations

import json
import math
import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax  # noqa: E402
import jax  # noqa: E402
from flax import nnx  # noqa: E402

import nnxscale  # noqa: E402
from nnxscale.sharding.layout import format_bytes  # noqa: E402

N_LAYERS, D_IN, D_OUT = 4, 4096, 16384
N_DEVICES = 8


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, kernel_init):
        self.layers = nnx.List(
            [nnx.Linear(D_IN, D_OUT, kernel_init=kernel_init, rngs=rngs) for _ in range(N_LAYERS)]
        )


def output_shard_bytes(compiled) -> int:
    """Bytes of the program's outputs that one device holds, from the output shardings."""
    shapes = jax.tree.leaves(compiled.out_info)
    shardings = jax.tree.leaves(compiled.output_shardings)
    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for a, s in zip(shapes, shardings, strict=True))


def nnxscale_init():
    mesh = nnxscale.make_mesh(f"model={N_DEVICES}")
    kernel_init = nnxscale.logical(nnx.initializers.lecun_normal(), "embed", "mlp")

    def factory():
        return Model(nnx.Rngs(0), kernel_init)

    program = nnxscale.compile_init(factory, mesh)
    planned = nnxscale.layout_bytes(nnx.eval_shape(factory), mesh)[0]
    shard = sum(output_shard_bytes(c) for c in program.compiled)
    assert shard == planned, (shard, planned)  # the plan and the compiled programs agree
    mem = program.memory()
    return mem["temp"], mem["output"], mem["peak"], shard, mem["programs"]


def flax_default_init():
    mesh = jax.make_mesh((N_DEVICES,), ("model",))  # Explicit axes, the default
    kernel_init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda: nnx.state(Model(nnx.Rngs(0), kernel_init))).lower().compile()
    stats = compiled.memory_analysis()
    temp, out = stats.temp_size_in_bytes, stats.output_size_in_bytes
    return temp, out, temp + out, output_shard_bytes(compiled), 1


def main() -> None:
    n_devices = jax.device_count()
    if n_devices != N_DEVICES:
        raise SystemExit(f"this benchmark needs {N_DEVICES} devices, jax sees {n_devices}: set XLA_FLAGS={_FLAG}=8")
    total = N_LAYERS * (D_IN * D_OUT + D_OUT) * 4
    print(
        f"sharded init of {N_LAYERS} x nnx.Linear({D_IN}, {D_OUT}) float32, {format_bytes(total)} of parameters, "
        f"kernels split over {N_DEVICES} {jax.devices()[0].platform.upper()} devices (compiled, not run)"
    )
    print(f"jax {jax.__version__}, flax {flax.__version__}")
    print()

    ratios, exact = {}, {}
    header = (
        f"{'init':<14}{'programs':>9}{'max temp/device':>17}{'output/device':>15}{'peak/device':>13}"
        f"{'shard/device':>14}{'peak/shard':>12}"
    )
    print(header)
    print("-" * len(header))
    for name, build in (("nnxscale", nnxscale_init), ("flax_default", flax_default_init)):
        temp, out, peak, shard, programs = build()
        exact[name] = peak / shard
        ratio = ratios[name] = round(exact[name], 2)
        print(
            f"{name:<14}{programs:>9}{format_bytes(temp):>17}{format_bytes(out):>15}{format_bytes(peak):>13}"
            f"{format_bytes(shard):>14}{ratio:>11.2f}x"
        )
    print()
    print(
        f"nnxscale needs {exact['flax_default'] / exact['nnxscale']:.1f}x less memory per device "
        f"than Flax's default eager sharding for the same init"
    )
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
