"""Low precision on the H100 compiler (issue 50): QLoRA's quantized base against LoRA's
bfloat16 one (the per-GPU peak, and whether it fits), and ``--fp8`` against bfloat16 (the
predicted step time, beside torchtitan's published FP8 speed-up).

    python bench/quantization.py            # about 10 minutes on 2 cores; needs the cuda13 (or cuda12) extra
    python bench/quantization.py --only fp8 # or --only qlora

Every figure is ``nnxscale plan --target ...`` through the Python API
(:func:`nnxscale.planning.plan`): the step compiled deviceless by XLA:GPU, rank-16 adapters on
every linear layer of the blocks, bfloat16 compute, ``--remat full``. Each row is the same
run with the base in bfloat16 (``lora``, the baseline), then stored ``nf4`` and ``int8``
(``--quantize-base``), and the ratio of their peaks to the baseline's.

On 2026-12-07 (jax 0.12.1, its CUDA 13 plugin): llama-3.1-70b on one H100 at 1 x 4,096 tokens
needs 140.9 GiB with the bfloat16 base (does not fit) and 50.6 GiB with NF4 (fits; 0.36x). The
rest of the table is in docs/quantization.md with the date it was run.

FP8: each row is the same run planned without and with ``--fp8`` (the stacked layers' linear
products on FP8 operands), ``--remat full``, bfloat16 compute; the ratio is bfloat16's predicted
step time over FP8's (the tokens/s speed-up). The baseline to compare it with is torchtitan's
published Float8 speed-up for Llama 3.1 8B on 8 H100s (benchmarks/llama3_h100_202412_torchtitan.md,
docs/performance.md in earlier versions; Table 1: FSDP +
torch.compile 6,667 tokens/s per GPU, with Float8 8,532: 1.28x; the issue quotes 5,762 to 7,186,
1.25x): a measured run, on 500 W H100s with 96 GB of HBM2e, where ours is a prediction for
700 W H100 SXM.

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
FP8_RUNS = [  # (model, target, mesh, global batch, seq, LoRA rank): torchtitan's 8B run (local batch 2 x 8,192)
    ("llama-3.1-8b", "h100x8", "fsdp=8", 16, 8192, None),
    ("llama-3.1-70b", "h100x8", "fsdp=8", 8, 4096, None),
    ("llama-3.1-70b", "h100x8", "fsdp=8", 8, 4096, 16),
]
TORCHTITAN_FP8 = 8532 / 6667  # Llama 3.1 8B, 8 H100s, FSDP + torch.compile, with Float8 over without


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


def fp8_command(model, target, mesh, batch, seq, rank, fp8) -> str:
    lora = f" --lora-rank {rank}" if rank else ""
    return (f"nnxscale plan --model {model} --target {target} --mesh {mesh}{lora} --batch-size {batch} --seq-len {seq} "
            f"--remat full --dtype bfloat16{' --fp8' if fp8 else ''}")  # fmt: skip


def fp8_planned(model, target, mesh, batch, seq, rank, fp8) -> dict:
    from nnxscale.planning import plan
    from nnxscale.training.config import TrainConfig, with_overrides

    fields = {"model.name": model, "parallel.mesh": mesh, "data.batch_size": batch, "data.seq_len": seq,
              "model.dtype": "bfloat16", "model.remat": "full", "lora.rank": rank, "model.fp8": fp8}  # fmt: skip
    t = time.perf_counter()
    p = plan(with_overrides(TrainConfig(), fields), target=target, compare=False)
    st = p.step_time
    return {"model": model, "target": target, "lora_rank": rank, "fp8": fp8, "peak_gib": p.peak_bytes / 2**30, "fits": p.fits,
            "step_s": st.seconds, "tokens_per_s_per_gpu": st.tokens_per_s_per_device, "fp8_gemm_share": st.fp8_gemm_share,
            "fp8_share": st.fp8_share, "all_gather_gib": p.collective_bytes.get("all-gather", 0) / 2**30,
            "seconds": time.perf_counter() - t, "command": fp8_command(model, target, mesh, batch, seq, rank, fp8)}  # fmt: skip


def fp8_table() -> list[dict]:
    rows = []
    print(f"{'model':15} {'run':9} {'precision':9} {'step':>9} {'tok/s/GPU':>10} {'FP8 of GEMMs':>13} {'gathered':>9} "
          f"{'peak/GPU':>9} {'fits':>5} {'speed-up':>9}")  # fmt: skip
    for run in FP8_RUNS:
        base = None
        for fp8 in (False, True):
            r = fp8_planned(*run, fp8)
            base = base or r["step_s"]
            r["speedup"] = base / r["step_s"]
            rows.append(r)
            kind = f"LoRA r{run[5]}" if run[5] else "full"
            print(f"{r['model']:15} {kind:9} {'fp8' if fp8 else 'bfloat16':9} {r['step_s']:7.3f} s {r['tokens_per_s_per_gpu']:10,.0f} "
                  f"{r['fp8_gemm_share']:13.1%} {r['all_gather_gib']:5.1f} GiB {r['peak_gib']:5.1f} GiB "
                  f"{'yes' if r['fits'] else 'no':>5} {r['speedup']:8.2f}x", flush=True)  # fmt: skip
    print(f"torchtitan, Llama 3.1 8B on 8 H100s, measured: {TORCHTITAN_FP8:.2f}x; ours for its run: {rows[1]['speedup']:.2f}x "
          f"predicted, ratio {rows[1]['speedup'] / TORCHTITAN_FP8:.2f}")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("qlora", "fp8"), help="one table (default: both)")
    args = parser.parse_args()
    rows = [] if args.only == "qlora" else fp8_table()
    if args.only != "fp8":
        rows += qlora_table()
    print(json.dumps(rows))


def qlora_table() -> list[dict]:
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
    return rows


if __name__ == "__main__":
    main()
