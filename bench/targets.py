"""The step compiled for accelerators this machine does not have, beside XLA:CPU's figure.

For each (model, mesh, target): ``nnxscale.plan(cfg, target=...)`` (the target's own compiler,
deviceless, in a child process) and ``nnxscale.plan(cfg)`` (XLA:CPU, simulated devices),
one JSON line each: peak GiB per chip, fits, collectives by kind (GiB), FLOPs per device,
compile seconds, and the XLA:CPU peak and collectives beside them with the ratio.

    python bench/targets.py                                  # the grid below (long: run it under the heavy lock)
    python bench/targets.py --models llama-3.2-1b --targets h100x8,v5p-16 --seq-len 4096 --no-cpu

Needs ``pip install 'nnxscale[tpu,cuda12]'``. A target whose compiler is missing is one line
saying so. Defaults: FSDP over every chip, global batch one sequence per chip of 4,096
tokens, bfloat16 compute over float32 weights, --remat full.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process compiles nothing for an accelerator

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402

from nnxscale.errors import NnxscaleError  # noqa: E402
from nnxscale.planning import targets  # noqa: E402
from nnxscale.planning.report import plan  # noqa: E402
from nnxscale.training.config import FLAT_NAMES, TrainConfig, with_overrides  # noqa: E402

GiB = 1 << 30


def config(model: str, mesh: str, batch: int, seq_len: int, remat: str) -> TrainConfig:
    fields = {"model": model, "mesh": mesh, "data.batch_size": batch, "data.seq_len": seq_len, "remat": remat, "dtype": "bfloat16"}
    return with_overrides(TrainConfig(), {FLAT_NAMES.get(k, k): v for k, v in fields.items()})


@functools.cache
def cpu_plan(model: str, mesh: str, batch: int, seq_len: int, remat: str):
    """XLA:CPU's plan of the same step: compiled once per mesh (h100x64 and v5p-128 share fsdp=64)."""
    return plan(config(model, mesh, batch, seq_len, remat), compile="always")


def row(model: str, target: targets.Target, args) -> dict:
    mesh = args.mesh or f"fsdp={target.chips}"
    batch = args.batch_size or target.chips
    cfg = config(model, mesh, batch, args.seq_len, args.remat)
    out = {"model": model, "mesh": mesh, "target": target.name, "batch": f"{batch}x{args.seq_len}", "remat": args.remat}
    try:
        p = plan(cfg, target=target)
    except NnxscaleError as e:
        return {**out, "error": str(e)}
    out.update(
        peak_gib=round(p.peak_bytes / GiB, 3),
        memory_gib=round(target.memory / GiB, 1),
        fits=p.fits,
        refused=p.refused,
        collectives_gib={k: round(v / GiB, 3) for k, v in p.collective_bytes.items() if v},
        flops_per_device=p.flops,
        flops_formula_per_device=p.flops_expected,
        attention=p.attention,
        compile_seconds=round(p.compile_seconds or 0, 1),
        notes=[n for n in p.notes if n.startswith("mesh")],
    )
    if args.cpu:
        cpu = cpu_plan(model, mesh, batch, args.seq_len, args.remat)
        out.update(
            cpu_peak_gib=round(cpu.peak_bytes / GiB, 3),
            cpu_collectives_gib=round(cpu.collective_total / GiB, 3),
            target_over_cpu_peak=round(p.peak_bytes / max(cpu.peak_bytes, 1), 3),
            cpu_compile_seconds=round(cpu.compile_seconds or 0, 1),
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b,mixtral-8x7b")
    ap.add_argument("--targets", default="h100x8,h100x64,v5p-128,v6e-256")
    ap.add_argument("--mesh", default=None, help="default: fsdp over every chip")
    ap.add_argument("--batch-size", type=int, default=None, help="default: one sequence per chip")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--remat", default="full")
    ap.add_argument("--no-cpu", dest="cpu", action="store_false", help="skip the XLA:CPU figure (a child process of simulated devices)")
    args = ap.parse_args()
    for model in args.models.split(","):
        for name in args.targets.split(","):
            print(json.dumps(row(model, targets.get(name), args)), flush=True)


if __name__ == "__main__":
    main()
