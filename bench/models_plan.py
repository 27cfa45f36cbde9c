"""Plan the decoder family's large presets for the accelerators people train them on.

Each row is ``nnxscale plan --target`` through the Python API (:func:`nnxscale.planning.plan`):
the training step compiled by the target's own compiler, deviceless, on this machine. Prints
one line per row (memory per chip, predicted step time, MFU, fits) and the command that gives
the same figures; a row whose compiler is not installed (libtpu for the TPU rows, the CUDA
plugin for the GPU rows) or that fails says so in its line and the others go on.

    python bench/models_plan.py                  # every row
    python bench/models_plan.py --rows qwen3-32b/h100x8,deepseek-v3/h100x256

Needs the ``cuda13`` (or ``cuda12``) extra for the H100 rows and the ``tpu`` extra for the
TPU rows. The big rows compile for minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import time

#: (model, target, mesh, global batch) at seq 4096, bfloat16 compute, remat full.
ROWS = [
    ("qwen3-32b", "h100x8", "fsdp=8", 16),
    ("gemma-3-27b", "v5p-64", "fsdp=32", 128),
    ("qwen3-235b-a22b", "h100x256", "fsdp=32,expert=8", 256),
    ("qwen3-235b-a22b", "v5p-1024", "fsdp=32,expert=16", 1024),
    ("deepseek-v3", "h100x256", "fsdp=32,expert=8", 256),
    ("deepseek-v3", "v5p-1024", "fsdp=32,expert=16", 1024),
]
SEQ, DTYPE, REMAT = 4096, "bfloat16", "full"


def command(model: str, target: str, mesh: str, batch: int) -> str:
    return (f"nnxscale plan --model {model} --target {target} --mesh {mesh} --batch-size {batch} "
            f"--seq-len {SEQ} --dtype {DTYPE} --remat {REMAT}")  # fmt: skip


def run_row(model: str, target: str, mesh: str, batch: int) -> dict:
    from nnxscale.planning import plan
    from nnxscale.training.config import FLAT_NAMES, TrainConfig, with_overrides

    fields = {"model": model, "mesh": mesh, "data.batch_size": batch, "data.seq_len": SEQ, "dtype": DTYPE, "remat": REMAT}
    cfg = with_overrides(TrainConfig(), {FLAT_NAMES.get(k, k): v for k, v in fields.items()})
    row = {"model": model, "target": target, "mesh": mesh, "batch": batch, "seq": SEQ, "command": command(model, target, mesh, batch)}
    t = time.perf_counter()
    try:
        p = plan(cfg, target=target, compare=False)
    except BaseException as e:  # noqa: BLE001  (a missing extra exits; a failing row is reported, the others run)
        if isinstance(e, KeyboardInterrupt):
            raise
        return {**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", "seconds": time.perf_counter() - t}
    st = p.step_time
    return {
        **row,
        "params": p.num_params,
        "peak_gib": p.peak_bytes / 2**30,
        "chip_gib": (p.device_memory or 0) / 2**30,
        "fits": p.fits,
        "step_s": st.seconds if st else None,
        "tokens_per_s_per_chip": st.tokens_per_s_per_device if st else None,
        "mfu": st.mfu if st else None,
        "flops_compiled": p.flops,
        "flops_formula": p.flops_recompute or p.flops_expected,
        "bottleneck": st.bottleneck if st else None,
        "seconds": time.perf_counter() - t,
    }


def line(r: dict) -> str:
    head = f"{r['model']} on {r['target']} ({r['mesh']}, {r['batch']} x {r['seq']})"
    if "error" in r:
        return f"{head}: not planned: {r['error']}"
    step = f"{r['step_s']:.2f} s/step, MFU {r['mfu']:.0%}" if r["step_s"] else "no step time"
    fits = "fits" if r["fits"] else "does not fit"
    return f"{head}: peak {r['peak_gib']:.1f} of {r['chip_gib']:.0f} GiB per chip ({fits}); {step}; planned in {r['seconds']:.0f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="", help="model/target,... (default: every row)")
    ap.add_argument("--json", action="store_true", help="one JSON object per row instead of a line")
    args = ap.parse_args()
    wanted = {tuple(x.split("/")) for x in args.rows.split(",") if x}
    for model, target, mesh, batch in ROWS:
        if wanted and (model, target) not in wanted:
            continue
        r = run_row(model, target, mesh, batch)
        print(json.dumps(r) if args.json else line(r), flush=True)
        if not args.json:
            print(f"  {r['command']}", flush=True)


if __name__ == "__main__":
    main()
