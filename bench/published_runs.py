"""nnxscale's predicted step time against published, measured training runs (bench/published_runs.json).

For each run: nnxscale's nearest configuration (the model, mesh, global batch, sequence,
gradient accumulation, ``--remat`` and ``--dtype`` the registry gives) planned for the run's
target by that target's own compiler (``nnxscale.plan(cfg, target=...)``: deviceless, in a
child process), and its predicted step time (``StepPlan.step_time``,
:mod:`nnxscale.planning.steptime`) set beside the published figure, as seconds per step and
tokens per second per device. One JSON line per run: fits, peak GiB per chip, predicted and
published seconds per step, the error (predicted / published - 1), where the predicted time
goes, compile seconds; then one line with the mean and worst absolute errors.

A run measured on parts other than its target's chip, whose authors describe them
(``run_hardware`` in the registry: HBM bandwidth, and the bfloat16 peaks its clock lies
between), is also planned on those figures (``on_run_hardware``: the chip's figures with
that bandwidth and each peak, registered for the compile's prediction); the summary line
counts the target's prediction.

    python bench/published_runs.py                                # every run (long: big deviceless compiles)
    python bench/published_runs.py --runs llmc-gpt2-1558m-h100x8 --lock /tmp/nnxscale-heavy.lock

``--lock FILE`` holds an exclusive ``flock`` on FILE around each compile (one big compile at a
time on a shared machine). Needs ``pip install 'nnxscale[tpu,cuda12]'``.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process compiles nothing for an accelerator

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from nnxscale.errors import NnxscaleError  # noqa: E402
from nnxscale.planning import targets  # noqa: E402
from nnxscale.planning.report import plan  # noqa: E402
from nnxscale.training.config import FLAT_NAMES, TrainConfig, with_overrides  # noqa: E402

HERE = Path(__file__).resolve().parent
REGISTRY = HERE / "published_runs.json"
GiB = 1 << 30


def config(run: dict) -> TrainConfig:
    """nnxscale's configuration of a published run."""
    model = str(HERE.parent / run["model"]) if run["model"].startswith("bench/") else run["model"]
    fields = {"model": model, "mesh": run["mesh"], "data.batch_size": run["batch_size"], "data.seq_len": run["seq_len"],
              "optim.grad_accum": run["grad_accum"], "remat": run["remat"], "dtype": run["dtype"]}  # fmt: skip
    return with_overrides(TrainConfig(), {FLAT_NAMES.get(k, k): v for k, v in fields.items()})


def maxtext_2023_flops_per_device(cfg: TrainConfig, per_device_batch: int) -> float:
    """FLOPs per device per step as MaxText counted them in December 2023 (MaxText/train.py
    ``calculate_training_tflops`` at 76bd53b0f): 6 x parameters x tokens, plus causal attention
    6 x heads x layers x head_dim x seq^2 x batch (half of 12 x ...), per device."""
    from nnxscale.training.model import model_architecture

    family, c = model_architecture(cfg.model.name)
    d, S = family.dims(c), cfg.data.seq_len
    return 6 * c.num_params() * S * per_device_batch + 6 * d.heads * d.layers * d.head_width * S**2 * per_device_batch


def published_seconds(run: dict, cfg: TrainConfig, chips: int) -> float:
    """The published figure as seconds per step."""
    pub, tokens = run["published"], cfg.data.batch_size * cfg.data.seq_len
    if "seconds_per_step" in pub:
        return pub["seconds_per_step"]
    if "tokens_per_s_per_device" in pub:
        return tokens / (pub["tokens_per_s_per_device"] * chips)
    if pub.get("flops_formula") == "maxtext-2023":
        return maxtext_2023_flops_per_device(cfg, run["run"]["per_device_batch"]) / (pub["tflops_per_s_per_device"] * 1e12)
    raise ValueError(f"{run['name']}: no published figure this script reads: {pub}")


@contextlib.contextmanager
def held(lock):
    if lock is None:
        yield
        return
    import fcntl

    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def row(run: dict, lock) -> dict:
    target = targets.get(run["target"])
    cfg = config(run)
    published = published_seconds(run, cfg, target.chips)
    tokens = cfg.data.batch_size * cfg.data.seq_len
    out = {"run": run["name"], "target": target.name, "mesh": run["mesh"], "batch": f"{cfg.data.batch_size}x{cfg.data.seq_len}",
           "grad_accum": cfg.optim.grad_accum, "remat": cfg.model.remat, "dtype": cfg.model.dtype,
           "published_s": round(published, 4), "published_tokens_per_s_per_device": round(tokens / published / target.chips, 1),
           "source": f"{run['source']['repo']}/{run['source']['path']} ({run['source']['date']})"}  # fmt: skip
    t = time.perf_counter()
    try:
        with held(lock):
            p = plan(cfg, target=target)
    except NnxscaleError as e:
        return {**out, "error": str(e)}
    out.update(fits=p.fits, peak_gib=round(p.peak_bytes / GiB, 2), memory_gib=round(target.memory / GiB, 1),
               compile_seconds=round(p.compile_seconds or 0, 1), wall_seconds=round(time.perf_counter() - t, 1),
               attention=p.attention)  # fmt: skip
    st = p.step_time
    if st is None:
        return {**out, "predicted_s": None, "error": "no prediction (refused by the compiler, or no hardware figures)"}
    out.update(
        predicted_s=round(st.seconds, 4),
        predicted_tokens_per_s_per_device=round(st.tokens_per_s_per_device, 1),
        predicted_mfu=None if st.mfu is None else round(st.mfu, 4),
        error=round(st.seconds / published - 1, 4),
        where={"compute_s": round(st.compute_s, 4), "memory_s": round(st.memory_s, 4), "overhead_s": round(st.overhead_s, 4),
               "collective_s": round(st.collective_s, 4), "exposed_collective_s": round(st.exposed_collective_s, 4)},
        bottleneck=st.bottleneck,
        notes=st.notes,
    )  # fmt: skip
    if "run_hardware" in run:
        out["on_run_hardware"] = on_run_hardware(run, cfg, target, published, lock)
    return out


def on_run_hardware(run: dict, cfg: TrainConfig, target, published: float, lock) -> list[dict]:
    """The run planned on its own parts' figures (``run_hardware``): the target chip's, with the
    run's HBM bandwidth and each of its bfloat16 peaks, registered for the prediction
    (:func:`nnxscale.planning.steptime.register_hardware`) and taken back after."""
    import dataclasses

    from nnxscale.planning import steptime

    figures, chip = run["run_hardware"], target.chip
    base = steptime.hardware_for(chip)
    saved = steptime._REGISTERED.get(chip)
    out = []
    try:
        for peak in figures["bfloat16_peaks"]:
            hw = dataclasses.replace(base, hbm_bandwidth=figures["hbm_bandwidth"], peak_flops={**base.peak_flops, "bfloat16": peak})
            steptime.register_hardware(chip, hw)
            with held(lock):
                st = plan(cfg, target=target, compare=False).step_time
            out.append({"hbm_bandwidth": figures["hbm_bandwidth"], "bfloat16_peak": peak, "predicted_s": round(st.seconds, 4),
                        "error": round(st.seconds / published - 1, 4), "compute_s": round(st.compute_s, 4),
                        "memory_s": round(st.memory_s, 4), "exposed_collective_s": round(st.exposed_collective_s, 4)})  # fmt: skip
    finally:
        if saved is None:
            steptime._REGISTERED.pop(chip, None)
        else:
            steptime._REGISTERED[chip] = saved
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=None, help="comma-separated run names (default: every run in the registry)")
    ap.add_argument("--lock", default=None, help="a file to flock around each compile")
    args = ap.parse_args()
    runs = json.loads(REGISTRY.read_text())["runs"]
    if args.runs:
        wanted = args.runs.split(",")
        unknown = sorted(set(wanted) - {r["name"] for r in runs})
        if unknown:
            raise SystemExit(f"unknown runs {unknown}: the registry has {', '.join(r['name'] for r in runs)}")
        runs = [r for r in runs if r["name"] in wanted]
    import jax

    print(json.dumps({"jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}), flush=True)
    rows = []
    for run in runs:
        rows.append(row(run, args.lock))
        print(json.dumps(rows[-1]), flush=True)
    errors = [abs(r["error"]) for r in rows if isinstance(r.get("error"), float)]
    if errors:
        print(json.dumps({"summary": True, "predicted": len(errors), "of": len(rows), "mean_abs_error": round(statistics.mean(errors), 4),
                          "worst_abs_error": round(max(errors), 4), "within_15pct": sum(e <= 0.15 for e in errors)}))  # fmt: skip


if __name__ == "__main__":
    main()
