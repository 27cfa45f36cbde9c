"""Predicted against measured step time on XLA:CPU: the step-time prediction checked where it can run.

For each (model, mesh), the trainer's own step (``setup`` -> ``init_state`` ->
``make_train_step``, compiled with the options a user gets: no test flags, LLVM at its
default level) is run on this machine's simulated CPU devices, and its median step time is
set beside :func:`nnxscale.planning.steptime.predict` of the same compiled program (its
``as_text()``) with this machine's XLA:CPU figures (:mod:`nnxscale.planning.calibration`),
measured again just before and just after each configuration's timed steps (their mean) so
both see the same load from other jobs.
One JSON line per configuration (predicted, measured, predicted / measured, where the
predicted time goes, the load average), then one line: the mean ratio, the mean and worst
absolute error. The issue's bar: each within 30%.

    python bench/steptime.py                          # 3 models x 3 meshes, 8 devices, the trainer's default batch
    python bench/steptime.py --models gpt2-mini --steps 10

Runs with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set here unless given.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

#: Three meshes per model: data parallel, FSDP, and each family's own kind of split.
MESHES = {
    "gpt2-mini": ("data=8", "fsdp=8", "data=4,model=2"),
    "llama-mini": ("data=8", "fsdp=8", "data=2,model=4"),
    "mixtral-mini": ("data=8", "fsdp=8", "data=2,expert=4"),
}


def measure(model: str, mesh: str, args) -> dict:
    import jax
    import numpy as np

    from nnxscale.planning import calibration, steptime
    from nnxscale.training.config import FLAT_NAMES, TrainConfig, with_overrides
    from nnxscale.training.state import init_state, setup
    from nnxscale.training.step import make_train_step

    fields = {"model": model, "mesh": mesh}
    if args.batch_size:
        fields["data.batch_size"] = args.batch_size
    if args.seq_len:
        fields["data.seq_len"] = args.seq_len
    cfg = with_overrides(TrainConfig(), {FLAT_NAMES.get(k, k): v for k, v in fields.items()})
    s = setup(cfg)
    state = init_state(s)
    step = make_train_step(s)
    B, T = cfg.data.batch_size, cfg.data.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, s.vocab_size(), (B, T + 1), dtype=np.int32)
    batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, s.batch_sharding)
    t = time.perf_counter()
    with jax.set_mesh(s.mesh):
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        first = time.perf_counter() - t
        compiled = step.lower(s.abstract, s.abstract_batch).compile()  # the program just run (a cache hit)
        for _ in range(args.warmup):
            state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
    load_before = os.getloadavg()[0]
    before = calibration.measure_host()  # now, under the load the steps will see
    times = []
    with jax.set_mesh(s.mesh):
        for _ in range(args.steps):
            t = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
    after = calibration.measure_host()
    # Each figure moves by up to a fifth from one measurement to the next on a shared host: the
    # mean of the two around the timed steps.
    figures = {k: (v + after[k]) / 2 if isinstance(v, float) else v for k, v in before.items()}
    n = s.mesh.devices.size
    hw = calibration.cpu_hardware(n, figures)
    st = steptime.predict(compiled.as_text(), hw, n_devices=n, tokens_per_step=B * T,
                          model_flops_per_step=s.flops_per_token() * B * T, compute_dtype=cfg.model.dtype,
                          fresh_bytes=steptime.fresh_bytes_of(compiled.memory_analysis()))  # fmt: skip
    measured = statistics.median(times)
    return {
        "model": model, "mesh": mesh, "batch": f"{B}x{T}", "devices": n,
        "predicted_s": round(st.seconds, 4), "measured_s": round(measured, 4), "ratio": round(st.seconds / measured, 3),
        "measured_min_max_s": [round(min(times), 4), round(max(times), 4)],
        "predicted": {"compute_s": round(st.compute_s, 4), "memory_s": round(st.memory_s, 4), "overhead_s": round(st.overhead_s, 4),
                      "exposed_collective_s": round(st.exposed_collective_s, 4), "fresh_memory_s": round(st.fresh_memory_s, 4),
                      "ops": st.ops, "notes": st.notes},
        "figures": {k: (round(v, 7) if isinstance(v, float) else v) for k, v in figures.items()},
        "first_step_s": round(first, 1), "load_avg": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MESHES))
    ap.add_argument("--meshes", default=None, help="meshes for every model (default: three per model, MESHES)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration (the median is reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=None, help="default: the trainer's")
    ap.add_argument("--seq-len", type=int, default=None, help="default: the trainer's")
    args = ap.parse_args()
    import jax

    import jaxlib

    print(json.dumps({"jax": jax.__version__, "jaxlib": jaxlib.__version__, "devices": jax.device_count(), "cores": os.cpu_count(),
                      "xla_flags": os.environ.get("XLA_FLAGS", ""), "date": time.strftime("%Y-%m-%d %H:%M")}), flush=True)  # fmt: skip
    rows = []
    for model in args.models.split(","):
        for mesh in args.meshes.split(";") if args.meshes else MESHES[model]:
            rows.append(measure(model, mesh, args))
            print(json.dumps(rows[-1]), flush=True)
    errors = [abs(r["ratio"] - 1) for r in rows]
    print(json.dumps({"summary": True, "rows": len(rows), "mean_ratio": round(statistics.mean(r["ratio"] for r in rows), 3),
                      "mean_abs_error": round(statistics.mean(errors), 3), "worst_abs_error": round(max(errors), 3),
                      "within_30pct": sum(e <= 0.30 for e in errors)}))  # fmt: skip


if __name__ == "__main__":
    main()
