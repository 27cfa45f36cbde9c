"""A LoRA step against a full fine-tune's step, on the same mesh (llama-mini on 8 CPU devices).

``python bench/lora.py`` (about 3 minutes on 2 cores): nnxscale's real train step for
``llama-mini`` (4 layers, width 192), global batch 32 x 128 byte tokens, on ``fsdp=8`` and on
``data=8``: every weight training (the baseline), and LoRA rank 16 on every linear layer
(``--lora-rank 16``: the base frozen, no gradient or optimizer state for it). Median of 15
steps after 3 of warm-up, the configs timed in turns (a shared machine's load falls on each
alike). Prints each step time and the LoRA/full ratio per mesh; the last line is JSON.

What the ratio shows on CPU: the compute a step does. LoRA's adapters add two thin matmuls
per adapted layer (rank 16 against widths of 192 and 512), and save the weight gradients'
matmuls of the frozen base and AdamW's update of every base weight.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from _step import prepared_step  # noqa: E402
from pipeline import timed_in_turns  # noqa: E402

from nnxscale.training.config import TrainConfig  # noqa: E402

MESHES = ("fsdp=8", "data=8")


def config(mesh: str, lora: bool) -> TrainConfig:
    flags = dict(model="llama-mini", mesh=mesh, batch_size=32, seq_len=128, min_shard_bytes=0)
    return TrainConfig.from_flags(**flags, **({"lora_rank": 16} if lora else {}))


def main() -> None:
    runs = {(mesh, lora): prepared_step(config(mesh, lora)) for mesh in MESHES for lora in (False, True)}
    times = timed_in_turns(runs)
    print("llama-mini train step, global batch 32 x 128, median of 15 steps (timed in turns)")
    ratios = {}
    for mesh in MESHES:
        full, lora = times[(mesh, False)], times[(mesh, True)]
        ratios[mesh] = lora / full
        print(f"  {mesh:<8} full fine-tune {full * 1e3:7.1f} ms   LoRA rank 16 {lora * 1e3:7.1f} ms   {lora / full:5.2f}x")
    print(json.dumps({f"lora_over_full_{m.replace('=', '')}": round(r, 3) for m, r in ratios.items()}))


if __name__ == "__main__":
    main()
