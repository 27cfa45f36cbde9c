"""The training step's own memory and communication, from the compiler, at real sizes.

Compiles nnxscale's real train step ahead of time (nothing allocated) on 8 simulated CPU
devices and reads the compiler's memory analysis and the collectives in its HLO:

- gpt2 (124M), global batch 8 x 1024, float32, on data=8 (the baseline), fsdp=8,
  data=2,model=4 and fsdp=8 with full rematerialization;
- gpt2-large (774M) on fsdp=8, for compile time against depth.

Compile time is lower + compile of the step (not ``setup``, which traces the model's
construction); for the depth ratio gpt2 and gpt2-large are compiled alternately, three
times each from a fresh jit, and the fastest of each counts (the other jobs of a shared
machine only ever add time). Prints a table, the analytical estimate's error against each
compiled peak, and last one JSON line:
``{"fsdp_over_dp_temp", "fsdp_collectives_over_params", "remat_over_none_temp", "compile_large_over_small"}``
(targets: <= 1.1, <= 3.2, <= 0.35, <= 1.5).

    python bench/train_memory.py
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from nnxscale.training.config import TrainConfig  # noqa: E402
from nnxscale.sharding.layout import format_bytes  # noqa: E402
from nnxscale.planning.compiler import measure  # noqa: E402
from nnxscale.planning.estimate import estimate  # noqa: E402
from nnxscale.planning.layout import layout_figures, mesh_sizes  # noqa: E402
from nnxscale.training.state import setup  # noqa: E402
from nnxscale.training.step import make_train_step  # noqa: E402

CONFIGS = [
    ("data=8", "gpt2", "data=8", "none"),
    ("fsdp=8", "gpt2", "fsdp=8", "none"),
    ("data=2,model=4", "gpt2", "data=2,model=4", "none"),
    ("fsdp=8 remat full", "gpt2", "fsdp=8", "full"),
    ("gpt2-large fsdp=8", "gpt2-large", "fsdp=8", "none"),
]


def compile_seconds(s) -> tuple[float, object]:
    """Seconds to lower and compile the step of setup ``s`` from a fresh jit, and the result."""
    t = time.perf_counter()
    with jax.set_mesh(s.mesh):
        compiled = make_train_step(s).lower(s.abstract, s.abstract_batch).compile()
    return time.perf_counter() - t, compiled


def config(model: str, mesh: str, remat: str) -> TrainConfig:
    return TrainConfig.from_flags(model=model, mesh=mesh, remat=remat, batch_size=8, seq_len=1024)


def main() -> None:
    rows = {}
    print("gpt2 / gpt2-large train step, global batch 8 x 1024, float32, 8 CPU devices (compiled, not run)")
    header = f"{'config':<20}{'temp/device':>13}{'peak/device':>13}{'collectives':>13}{'compile s':>11}{'estimate':>10}"
    print(header)
    print("-" * len(header))
    for name, model, mesh, remat in CONFIGS:
        cfg = config(model, mesh, remat)
        s = setup(cfg)
        seconds, compiled = compile_seconds(s)
        m = measure(compiled)
        lay = layout_figures(cfg, mesh_sizes(cfg.parallel.mesh))
        est = estimate(cfg, lay)["peak_bytes_per_device"]
        coll = sum(m["collective_bytes"].values()) / lay["full_param_bytes"]
        rows[name] = dict(m, compile_seconds=seconds, collectives_over_params=coll, estimate=est)
        print(
            f"{name:<20}{format_bytes(m['temp_bytes']):>13}{format_bytes(m['peak_bytes']):>13}"
            f"{coll:>12.2f}x{seconds:>11.1f}{est / m['peak_bytes'] - 1:>+10.0%}",
            flush=True,
        )
    print("collectives: bytes per device per step over the parameter bytes; estimate: the analytical")
    print("estimate's peak against the compiler's (nnxscale.planning.estimate.estimate)")
    setups = {m: setup(config(m, "fsdp=8", "none")) for m in ("gpt2", "gpt2-large")}
    best = {m: float("inf") for m in setups}
    for _ in range(3):
        for m, s in setups.items():
            best[m] = min(best[m], compile_seconds(s)[0])
    print(f"compile, fastest of 3 alternating: gpt2 {best['gpt2']:.1f} s (12 layers), gpt2-large {best['gpt2-large']:.1f} s (36 layers)")
    r = rows
    print(
        json.dumps(
            {
                "fsdp_over_dp_temp": round(r["fsdp=8"]["temp_bytes"] / r["data=8"]["temp_bytes"], 3),
                "fsdp_collectives_over_params": round(r["fsdp=8"]["collectives_over_params"], 3),
                "remat_over_none_temp": round(r["fsdp=8 remat full"]["temp_bytes"] / r["fsdp=8"]["temp_bytes"], 3),
                "compile_large_over_small": round(best["gpt2-large"] / best["gpt2"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
