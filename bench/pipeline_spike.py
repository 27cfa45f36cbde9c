"""Is a pipelined run's drift after a loss spike the schedule's, or the run's? (issue 34)

``python bench/pipeline_spike.py [--lr 3e-3]`` (about 4 minutes of CPU on 2 cores): gpt2-mini
trained 20 steps on the same text (a few standard-library modules' source, as the tests'
corpus), batch 16 x 32, warmup 2, from the same seed, on ``data=8`` (the reference),
``fsdp=8`` (no pipeline: another reduction order), GPipe, 1F1B and interleaved 1F1B (R=2) on
``stage=2,data=4`` with M=4, under the test suite's XLA flags. Prints, against ``data=8``,
the largest relative difference of the loss and of the gradient norm before the largest
gradient norm of the reference run (its spike) and from it on; the last line is JSON.

A spike amplifies last-bit differences of the steps before it: if ``fsdp=8`` drifts from
``data=8`` after the spike as much as the pipelines do, the drift is the run's (float
chaos), not the schedule's.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import tempfile
import typing

os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
)
os.environ.setdefault("NNXSCALE_STEP_XLA_OPTIONS", '{"xla_backend_optimization_level": 1}')  # as tests' many_steps

from nnxscale.training.config import TrainConfig, with_overrides  # noqa: E402
from nnxscale.planning.trainer import train  # noqa: E402  (nnxscale.train: the predicted step beside the measured)
from nnxscale.training.rundir import read_metrics  # noqa: E402

RUNS = {
    "data=8": {"parallel.mesh": "data=8"},
    "fsdp=8": {"parallel.mesh": "fsdp=8"},
    "gpipe": {"parallel.mesh": "stage=2,data=4", "parallel.microbatches": 4},
    "1f1b": {"parallel.mesh": "stage=2,data=4", "parallel.microbatches": 4, "parallel.pipeline_schedule": "1f1b"},
    "1f1b R=2": {"parallel.mesh": "stage=2,data=4", "parallel.microbatches": 4, "parallel.pipeline_schedule": "1f1b",
                 "parallel.pipeline_repeats": 2},
}  # fmt: skip


def run(name: str, lr: float, data: str, root: str) -> list[dict]:
    fields = {
        "model.name": "gpt2-mini", "parallel.min_shard_bytes": 0, "steps": 20, "logging.log_every": 1, "logging.eval_every": 0,
        "checkpoint.save_every": 100, "run_dir": os.path.join(root, name), "data.data": data, "data.seq_len": 32,
        "data.batch_size": 16, "optim.warmup_steps": 2, "optim.min_lr_ratio": 1.0, "optim.decay_steps": 100,
        "optim.lr": lr, **RUNS[name],
    }  # fmt: skip
    train(with_overrides(TrainConfig(), fields), progress=False, log=lambda _: None)
    return read_metrics(fields["run_dir"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        data = os.path.join(root, "corpus.txt")
        with open(data, "w") as f:
            f.write("\n".join(inspect.getsource(m) for m in (argparse, dataclasses, inspect, typing)))
        logs = {name: run(name, args.lr, data, root) for name in RUNS}
    ref = logs["data=8"]
    spike = max(range(len(ref)), key=lambda i: ref[i]["grad_norm"])
    print(f"gpt2-mini, 20 steps, lr {args.lr:g}: the reference's largest gradient norm {ref[spike]['grad_norm']:.1f} "
          f"at step {ref[spike]['step']}; largest relative difference from data=8")  # fmt: skip
    out = {"lr": args.lr, "spike_step": ref[spike]["step"]}
    for name, log in logs.items():
        if name == "data=8":
            continue
        rel = lambda k, part: max(abs(a[k] - b[k]) / abs(b[k]) for a, b in list(zip(log, ref))[part])  # noqa: E731
        before, after = slice(0, spike), slice(spike, None)
        figures = {"loss_before": rel("loss", before), "grad_norm_before": rel("grad_norm", before),
                   "loss_after": rel("loss", after), "grad_norm_after": rel("grad_norm", after)}  # fmt: skip
        out[name] = {k: float(f"{v:.3g}") for k, v in figures.items()}
        print(f"  {name:<9} before the spike: loss {figures['loss_before']:.1e}, gradient norm "
              f"{figures['grad_norm_before']:.1e};  from it on: loss {figures['loss_after']:.1e}, gradient norm "
              f"{figures['grad_norm_after']:.1e}")  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
