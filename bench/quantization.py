"""QLoRA's quantized base against LoRA's bfloat16 one: the per-GPU peak the H100 compiler
gives, and whether it fits (issue 50).

    python bench/quantization.py            # a few minutes on 2 cores; needs the cuda13 (or cuda12) extra

Every figure is ``nnxscale plan --target ...`` through the Python API
(:func:`nnxscale.planning.plan`): the step compiled deviceless by XLA:GPU, rank-16 adapters on
every linear layer of the blocks, bfloat16 compute, ``--remat full``. Each row is the same
run with the base in bfloat16 (``lora``, the baseline), then stored ``nf4`` and ``int8``
(``--quantize-base``), and the ratio of their peaks to the baseline's.

On 2026-12-07 (jax 0.12.1, its CUDA 13 plugin): llama-3.1-70b on one H100 at 1 x 4,096 tokens
needs 140.9 GiB with the bfloat16 base (does not fit) and 50.6 GiB with NF4 (fits; 0.36x). The
rest of the table is in docs/quantization.md with the date it was run. FP8 training
(``--fp8``) is not implemented yet: this script has no FP8 column.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import time

RUNS = [  # (model, target, mesh, global batch, seq)
    ("llama-3.1-8b", "h100x1", "fsdp=1", 1, 4096),
    ("llama-3.1-70b", "h100x1", "fsdp=1", 1, 4096),
    ("llama-3.1-70b", "h100x8", "fsdp=8", 8, 4096),
]
BASES = (None, "nf4", "int8")


def command(model, target, mesh, batch, seq, base) -> str:
    quantized = f" --quantize-base {base}" if base else ""
    return (f"nnxscale plan --model {model} --target {target} --mesh {mesh} --lora-rank 16{quantized} "
            f"--batch-size {batch} --seq-len {seq} --remat full --dtype bfloat16")  # fmt: skip


def planned(model, target, mesh, batch, seq, base) -> dict:
    from nnxscale.planning import plan
    from nnxscale.training.config import TrainConfig, with_overrides

    fields = {"model.name": model, "parallel.mesh": mesh, "data.batch_size": batch, "data.seq_len": seq,
              "model.dtype": "bfloat16", "model.remat": "full", "lora.rank": 16, "lora.quantize_base": base}  # fmt: skip
    t = time.perf_counter()
    p = plan(with_overrides(TrainConfig(), fields), target=target, compare=False)
    return {"model": model, "target": target, "base": base or "bfloat16", "peak_gib": p.peak_bytes / 2**30,
            "param_gib": p.param_bytes / 2**30, "fits": p.fits, "step_s": p.step_time.seconds if p.step_time else None,
            "seconds": time.perf_counter() - t, "command": command(model, target, mesh, batch, seq, base)}  # fmt: skip


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    rows = []
    print(f"{'model':15} {'target':8} {'base':9} {'params/GPU':>11} {'peak/GPU':>10} {'fits':>5} {'peak / lora':>12}")
    for run in RUNS:
        baseline = None
        for base in BASES:
            r = planned(*run, base)
            baseline = baseline or r["peak_gib"]
            r["peak_over_lora"] = r["peak_gib"] / baseline
            rows.append(r)
            print(f"{r['model']:15} {r['target']:8} {r['base']:9} {r['param_gib']:7.1f} GiB {r['peak_gib']:6.1f} GiB "
                  f"{'yes' if r['fits'] else 'no':>5} {r['peak_over_lora']:12.2f}", flush=True)  # fmt: skip
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
