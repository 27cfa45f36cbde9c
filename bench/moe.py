"""Mixture of experts: what an expert axis saves, what it moves, and what routing costs.

    python bench/moe.py [--batch 32] [--seq 128] [--steps 15]

On 8 simulated CPU devices, mixtral-mini (8 experts of width 256, top 2, 4 layers), global
batch ``--batch`` x ``--seq``, float32:

- ``expert_bytes_ratio``: the experts' weight bytes per device on ``expert=8`` over those on
  ``data=8`` (from the layout of the compiled step; nothing allocated). Ideal: 1/8.
- ``all_to_all_over_formula``: the all-to-all bytes per device per step of the step
  compiled for ``expert=8`` over the formula ``tokens per device x k x width x 4 bytes x 2
  (there and back) x 2 (forward and backward) x layers``. Dropless on CPU, each peer's slot
  holds all of a device's assignments (``jax.lax.ragged_all_to_all``, which sends only what
  is there, is not implemented by XLA:CPU), so expect about ``expert`` = 8.
- ``step_time_vs_dense``: mixtral-mini's measured train step over that of a dense Llama with
  the same active parameters per token (its MLP ``k`` x 256 wide, the router aside), same
  tokens, same mesh (``data=8``), timed in turns after warm-up (median of ``--steps``).
  A one-hot dispatch over every expert would cost about E/k = 4x the MLP's work.
- ``capacity_all_to_all_over_formula``: the same ratio with ``--capacity-factor 1.25``
  (each expert takes at most 1.25x its even share of a sequence's assignments; the rest
  are dropped): a peer's slot holds what the capacity lets a device send it, so expect
  about 1.25 instead of 8.
- ``capacity_step_time_vs_dropless``: the measured step on ``expert=8`` with that capacity
  over the dropless one, timed in the same turns.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import nnxscale  # noqa: E402
from nnxscale.models import llama, mixtral  # noqa: E402
from nnxscale.training.config import TrainConfig  # noqa: E402
from nnxscale.training.state import setup  # noqa: E402
from _step import prepared_step  # noqa: E402  (bench/_step.py)

DENSE = "llama-mini-dense-twin"  # registered below, for this bench only


CAPACITY = 1.25


def config(model: str, mesh: str, batch: int, seq: int, **more) -> TrainConfig:
    return TrainConfig.from_flags(model=model, mesh=mesh, batch_size=batch, seq_len=seq, min_shard_bytes=0, **more)


def all_to_all(cfg: TrainConfig) -> int:
    """The compiled step's all-to-all bytes per device."""
    return nnxscale.plan(cfg, compile="always").collective_bytes.get("all-to-all", 0)


def expert_bytes(s) -> int:
    """Bytes per device of the experts' weights (w1, w2, w3) in the layout of setup ``s``."""
    flat = jax.tree_util.tree_flatten_with_path(s.abstract["params"])[0]
    total = 0
    for path, leaf in flat:
        if jax.tree_util.keystr(path).endswith(("['w1']", "['w2']", "['w3']")):
            total += math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    c = mixtral.PRESETS["mixtral-mini"]
    fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(llama.LlamaConfig)}
    llama.PRESETS[DENSE] = llama.LlamaConfig(**(fields | {"intermediate_size": c.num_experts_per_tok * c.intermediate_size}))
    dense = llama.PRESETS[DENSE]
    print(f"mixtral-mini: {c.num_params():,} parameters, {c.active_params():,} active per token; dense twin "
          f"(Llama, MLP {dense.intermediate_size} wide): {dense.num_params():,}; batch {args.batch} x {args.seq}, "
          f"{jax.device_count()} {jax.devices()[0].platform} devices")  # fmt: skip

    on_data, on_expert = setup(config("mixtral-mini", "data=8", args.batch, args.seq)), None
    on_expert = setup(config("mixtral-mini", "expert=8", args.batch, args.seq))
    ratio = expert_bytes(on_expert) / expert_bytes(on_data)
    print(f"expert weights per device: data=8 {expert_bytes(on_data):,} B, expert=8 {expert_bytes(on_expert):,} B "
          f"(ratio {ratio:.4f})")  # fmt: skip

    t = time.perf_counter()
    plan = nnxscale.plan(config("mixtral-mini", "expert=8", args.batch, args.seq), compile="always")
    a2a = plan.collective_bytes.get("all-to-all", 0)
    tokens_per_device = args.batch * args.seq // 8
    formula = tokens_per_device * c.num_experts_per_tok * c.hidden_size * 4 * 2 * 2 * c.num_hidden_layers
    print(f"expert=8 step compiled in {time.perf_counter() - t:.1f} s: all-to-all {a2a:,} B per device per step, "
          f"formula {formula:,} B (ratio {a2a / formula:.2f}); all-gather {plan.collective_bytes.get('all-gather', 0):,} B")  # fmt: skip

    capped = all_to_all(config("mixtral-mini", "expert=8", args.batch, args.seq, capacity_factor=CAPACITY))
    print(f"expert=8 with --capacity-factor {CAPACITY}: all-to-all {capped:,} B per device per step (ratio {capped / formula:.2f})")

    runs = {"mixtral-mini": prepared_step(config("mixtral-mini", "data=8", args.batch, args.seq)),
            "dense twin": prepared_step(config(DENSE, "data=8", args.batch, args.seq)),
            "expert=8": prepared_step(config("mixtral-mini", "expert=8", args.batch, args.seq)),
            f"expert=8 cf {CAPACITY}": prepared_step(config("mixtral-mini", "expert=8", args.batch, args.seq,
                                                            capacity_factor=CAPACITY))}  # fmt: skip
    for run in runs.values():
        for _ in range(3):
            run()
    times = {k: [] for k in runs}
    for _ in range(args.steps):
        for k, run in runs.items():
            t = time.perf_counter()
            run()
            times[k].append(time.perf_counter() - t)
    median = {k: statistics.median(v) for k, v in times.items()}
    for k, v in median.items():
        print(f"{k:<18} {v * 1e3:8.1f} ms/step (median of {args.steps})")
    print(json.dumps({
        "expert_bytes_ratio": round(ratio, 4), "all_to_all_over_formula": round(a2a / formula, 2),
        "step_time_vs_dense": round(median["mixtral-mini"] / median["dense twin"], 3),
        "capacity_all_to_all_over_formula": round(capped / formula, 2),
        "capacity_step_time_vs_dropless": round(median[f"expert=8 cf {CAPACITY}"] / median["expert=8"], 3),
        "all_to_all_bytes": a2a, "formula_bytes": formula, "batch": args.batch, "seq": args.seq,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
