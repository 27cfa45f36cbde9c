"""CPU seconds of a training run at LLVM -O0, with and without its step at -O1.

    python bench/step_options.py [--models gpt2-tiny,gpt2-mini,llama-mini] [--steps 2,22]

The test suite compiles every program at ``--xla_backend_optimization_level=0`` (compiling
dominates its short runs) and, for the tests marked ``many_steps``, the training step alone
at level 1 (``NNXSCALE_STEP_XLA_OPTIONS``, tests/conftest.py). Each figure here is one
``nnxscale.train`` of the model on ``data=8``, batch 16 x 32 of this file's own source
repeated, in a new process with the compilation cache off (so every program is compiled,
as in a cold suite): the CPU seconds of the whole run (compiling and stepping), from
``getrusage``, so a loaded machine changes them less than wall time.

The last line is JSON: per model and step count ``[-O0 s, step at -O1 s, ratio]``, ratio =
step at -O1 / -O0; the difference between two step counts is the steps' own cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

OPTIONS = '{"xla_backend_optimization_level": 1}'

CHILD = r"""
import os, resource, sys, tempfile
from pathlib import Path
import nnxscale
model, steps, data = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = nnxscale.TrainConfig.from_flags(model=model, mesh="data=8", steps=steps, batch_size=16, seq_len=32,
                                      data=data, run_dir=tempfile.mkdtemp() + "/run", save_every=0, eval_every=0)
before = resource.getrusage(resource.RUSAGE_SELF)
nnxscale.train(cfg, progress=False, log=lambda _: None)
after = resource.getrusage(resource.RUSAGE_SELF)
print(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
"""


def run(model: str, steps: int, data: str, step_options: str | None) -> float:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false",
               XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")  # fmt: skip
    env.pop("NNXSCALE_STEP_XLA_OPTIONS", None)
    if step_options:
        env["NNXSCALE_STEP_XLA_OPTIONS"] = step_options
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(steps), data], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt2-tiny,gpt2-mini,llama-mini")
    parser.add_argument("--steps", default="2,22")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "corpus.txt")
        with open(__file__) as f:
            text = f.read()
        with open(data, "w") as f:
            f.write(text * (200_000 // len(text) + 1))
        results = {}
        for model in args.models.split(","):
            for steps in map(int, args.steps.split(",")):
                base, opt = run(model, steps, data, None), run(model, steps, data, OPTIONS)
                results[f"{model} {steps} steps"] = [round(base, 2), round(opt, 2), round(opt / base, 3)]
                print(f"{model:12s} {steps:3d} steps: -O0 {base:6.2f} s, step at -O1 {opt:6.2f} s, ratio {opt / base:.3f}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
