"""Long sequences on the accelerators' own compilers: is memory linear in T there too?

``bench/long_context.py`` shows the 16k / 4k rule on XLA:CPU. This compiles the same real
train step ahead of time, deviceless, for accelerators that are not here
(``bench/_targets.py``: 8 H100s through the CUDA plugin, a TPU v5e-8 through libtpu), where
``--attention auto`` picks the target's kernel (cuDNN's fused attention in bfloat16 on NVIDIA,
the Pallas GPU flash kernel with ``--document-mask``, Pallas splash attention on TPU):

- llama-3.2-1b, ``fsdp=8``, ``--remat full``, global batch 8 (one sequence per device),
  bfloat16, at T = 4,096 and 16,384: per device, the program's working memory (its peak less
  its arguments: activations and temporaries) and its peak as that compiler reports it (TPU
  ``peak_memory_in_bytes``; elsewhere arguments + outputs - aliased + temporaries);
- the same with the baseline of ``bench/long_context.py`` in the same run (``--attention xla``,
  the loss over all logits, the whole MLP). A TPU refuses a program larger than its memory:
  that is printed as the refusal's own figure.

Prints a table and, last, one JSON line ``{target: {"working_16k_over_4k", ...}}`` (target:
``working_16k_over_4k`` <= 4.5 for ``auto``, as on CPU).

    python bench/long_context_targets.py [--targets h100x8,v5e-8]
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"  # before jax starts: the targets are compiled for, not run on

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from _targets import TARGETS, target_mesh  # noqa: E402
from long_context import baseline  # noqa: E402

from nnxscale.layers import attention  # noqa: E402
from nnxscale.sharding.layout import format_bytes  # noqa: E402
from nnxscale.training.config import TrainConfig  # noqa: E402
from nnxscale.training.state import setup  # noqa: E402
from nnxscale.training.step import make_train_step  # noqa: E402

GIB = 1 << 30
LENGTHS = (4096, 16384)


def compile_for(cfg: TrainConfig, mesh) -> dict:
    """The step of ``cfg`` compiled for ``mesh``'s devices: working and peak bytes per device,
    the attention line, the seconds; or the compiler's refusal."""
    s = setup(cfg, mesh=mesh, separator=0 if cfg.data.document_mask else None)
    c = s.model.config
    line = attention.describe(c.attention, cfg.data.seq_len, c.dtype, s.model.dims.head_width, 1,
                              cfg.data.document_mask, attention.platform_of(mesh))  # fmt: skip
    t = time.perf_counter()
    try:
        with jax.set_mesh(s.mesh):
            ma = make_train_step(s).lower(s.abstract, s.abstract_batch).compile().memory_analysis()
    except Exception as e:  # noqa: BLE001  the TPU compiler's "RESOURCE_EXHAUSTED ... exceeds available HBM"
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        need = re.search(r"\(([\d.]+[KMGT]?)\) exceeds available HBM", str(e))
        return {"line": line, "refused": f"temporaries {need[1]} > HBM" if need else str(e).splitlines()[0][:60],
                "seconds": time.perf_counter() - t}  # fmt: skip
    peak = getattr(ma, "peak_memory_in_bytes", 0) or (
        ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    )
    return {"line": line, "peak": peak, "working": peak - ma.argument_size_in_bytes, "seconds": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="h100x8,v5e-8", help=f"comma-separated, of {', '.join(TARGETS)}")
    targets = ap.parse_args().targets.split(",")
    print("llama-3.2-1b, fsdp=8, --remat full, global batch 8, bfloat16 (compiled for the target, deviceless)")
    print(f"{'target':8}{'':34}{'T':>8}{'working':>14}{'peak':>14}{'compile s':>11}  attention")
    summary = {}
    for target in targets:
        mesh = target_mesh(target, "fsdp=8")
        runs = [("baseline (xla, whole loss)", "xla", False, baseline), ("nnxscale (auto)", "auto", False, contextlib.nullcontext)]
        if attention.platform_of(mesh) == "nvidia":  # the other NVIDIA kernel: cuDNN takes no document mask here
            runs.append(("nnxscale (auto, --document-mask)", "auto", True, contextlib.nullcontext))
        figures = {}
        for name, impl, documents, ctx in runs:
            for T in LENGTHS:
                cfg = TrainConfig.from_flags(model="llama-3.2-1b", mesh="fsdp=8", remat="full", batch_size=8, seq_len=T,
                                             dtype="bfloat16", attention=impl, document_mask=documents)  # fmt: skip
                with ctx():
                    r = compile_for(cfg, mesh)
                figures[name, T] = r
                memory = (f"{format_bytes(r['working']):>14}{format_bytes(r['peak']):>14}" if "peak" in r
                          else f"{'refused: ' + r['refused']:>28}")  # fmt: skip
                print(f"{target:8}{name:34}{T:>8,}{memory}{r['seconds']:>11.1f}  {r['line']}", flush=True)
        summary[target] = {}
        for name, *_ in runs:
            small, big = figures[name, LENGTHS[0]], figures[name, LENGTHS[1]]
            key = "auto" if name == "nnxscale (auto)" else "documents" if "document" in name else "baseline"
            if "working" in small and "working" in big:
                ratio = big["working"] / small["working"]
                print(f"  {target} {name}: 16k / 4k working memory {ratio:.2f}x")
                summary[target][f"{key}_working_16k_over_4k"] = round(ratio, 3)
                summary[target][f"{key}_peak_16k_gib"] = round(big["peak"] / GIB, 3)
            else:
                summary[target][f"{key}_16k"] = big.get("refused", "compiled")
        summary[target]["attention"] = figures["nnxscale (auto)", LENGTHS[1]]["line"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
