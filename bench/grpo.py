"""GRPO's rollouts (issue 51): sampling with the KV cache against recomputing the whole
sequence per token, and how a GRPO step's time splits between the rollout and training.

    python bench/grpo.py [--model llama-mini] [--mesh fsdp=2,model=4] [--rows 32] [--prompt-len 24] [--new 64] [--steps 12]

1. Rollout tokens/s. The model is created in its sharded layout on 8 simulated CPU devices
   (random weights) and samples ``--new`` tokens for each of ``--rows`` prompts (a step's
   completions: prompts x ``--num-generations``) at temperature 1, as a GRPO rollout does, with
   :class:`nnxscale.models.common.generate.Generator`: with the KV cache (what ``train
   --objective grpo`` runs), and recomputing the whole window per token (``cache=False``, the
   baseline). Both are timed warm (compiled and run once before).
2. The step's split: ``--steps`` steps of ``train --objective grpo`` (the Python API) on a
   byte-level prompt file written here, a reward counting lowercase letters; from
   ``metrics.jsonl``: the rollout's seconds (``rollout_s``: sampling) against the step's
   (``step_time_s``: rollout, rewards and the optimizer step), steps after the first three
   (compiling).

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import nnxscale  # noqa: E402
from nnxscale.models import find_preset  # noqa: E402
from nnxscale.models.common.generate import Generator, Sampling  # noqa: E402

REWARD = "def lowercase(prompts, completions, **fields):\n    return [sum('a' <= ch <= 'z' for ch in c) / max(len(c), 1) for c in completions]\n"


def rollout_speed(args) -> dict:
    family, config = find_preset(args.model)
    mesh = nnxscale.make_mesh(args.mesh)
    rules = nnxscale.resolve(None, mesh)
    model = nnxscale.sharded_init(lambda: family.build(config, rngs=nnx.Rngs(0)), mesh, rules)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, config.vocab_size, args.prompt_len).tolist() for _ in range(args.rows)]
    length = args.prompt_len + args.new
    sampling = Sampling(temperature=1.0, top_k=0, seed=1)
    out = {}
    for name, cache in (("cached", True), ("recompute", False)):
        generate = Generator(model, family.dims(config).context, rules, cache=cache)
        generate(prompts, 1, sampling, length=length)  # compiles
        t = time.perf_counter()
        tokens = generate(prompts, args.new, sampling, length=length)
        seconds = time.perf_counter() - t
        drawn = sum(len(x) for x in tokens)
        out[name] = {"seconds": seconds, "tokens": drawn, "tokens_per_s": drawn / seconds}
        print(f"{name:9} {seconds:7.2f} s for {args.rows} x {args.new} tokens: {drawn / seconds:8,.0f} tokens/s", flush=True)
    out["cached_over_recompute"] = out["cached"]["tokens_per_s"] / out["recompute"]["tokens_per_s"]
    print(f"the KV cache samples {out['cached_over_recompute']:.1f}x faster", flush=True)
    return out


def step_split(args) -> dict:
    from nnxscale import train
    from nnxscale.training.config import TrainConfig, with_overrides
    from nnxscale.training.rundir import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "r.py").write_text(REWARD)
        (tmp / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Write something ({i}): "}) + "\n" for i in range(64)))
        fields = {"model.name": args.model, "parallel.mesh": args.mesh, "objective": "grpo", "data.data": str(tmp / "prompts.jsonl"),
                  "grpo.reward": (f"{tmp / 'r.py'}:lowercase",), "grpo.num_generations": 8, "data.batch_size": args.rows,
                  "data.seq_len": args.prompt_len + args.new, "grpo.max_new_tokens": args.new, "steps": args.steps,
                  "logging.log_every": 1, "run_dir": str(tmp / "run")}  # fmt: skip
        train(with_overrides(TrainConfig(), fields), progress=False, log=lambda _: None)
        records = read_metrics(tmp / "run")[3:]
    rollout = float(np.mean([r["rollout_s"] for r in records]))
    step = float(np.mean([r["step_time_s"] for r in records]))
    print(f"a GRPO step: {step:.3f} s, of it the rollout (sampling) {rollout:.3f} s ({rollout / step:.0%}); rewards and the "
          f"optimizer step {step - rollout:.3f} s (mean of steps 4 to {args.steps})", flush=True)  # fmt: skip
    return {"step_s": step, "rollout_s": rollout, "rollout_share": rollout / step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-mini")
    p.add_argument("--mesh", default="fsdp=2,model=4")
    p.add_argument("--rows", type=int, default=32, help="completions per step (prompts x 8 generations)")
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    print(f"{args.model} on {args.mesh}: {args.rows} completions of {args.new} tokens after {args.prompt_len}-token prompts")
    out = {"rollout": rollout_speed(args), "step": step_split(args), "model": args.model, "mesh": args.mesh}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
