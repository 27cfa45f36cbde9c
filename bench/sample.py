"""What the KV cache buys: decoding gpt2 (124M) with the cache against recomputing the sequence.

    python bench/sample.py [--model gpt2] [--mesh data=2,model=4] [--prompt-len 64] [--new 512]
                           [--rows 2] [--recompute-tokens 16] [--full]

The model is created in its sharded layout on 8 simulated CPU devices (random weights: the
work per token does not depend on them) and continues ``--rows`` prompts of ``--prompt-len``
tokens greedily, ``--new`` tokens each, with :class:`nnxscale.models.common.generate.Generator`:

  cached     the KV cache: one prefill of the prompts, then one position per token
  recompute  the baseline (``cache=False``): every token runs the whole window of
             prompt + new tokens (576 for the defaults) through the model, as sampling did
             before the cache

Both are timed warm: each program is compiled (and run once) before it is timed. Every
recomputed token runs the same program on the same window, so the baseline is timed over
``--recompute-tokens`` tokens and scaled to ``--new`` (``--full`` times all of them; about
half an hour for the defaults on 2 cores). The greedy tokens of the two are compared over
the tokens both produced.

The last line is JSON: ``{"cached_over_recompute": recompute seconds / cached seconds, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import nnxscale  # noqa: E402
from nnxscale.models import find_preset  # noqa: E402
from nnxscale.models.common.generate import ROUND_TO, Generator, Sampling  # noqa: E402


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--mesh", default="data=2,model=4")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--rows", type=int, default=2, help="prompts decoded together (default: one per data shard)")
    p.add_argument("--recompute-tokens", type=int, default=16, help="recomputed tokens timed, scaled to --new")
    p.add_argument("--full", action="store_true", help="time the recomputation of every token")
    args = p.parse_args()

    family, config = find_preset(args.model)
    mesh = nnxscale.make_mesh(args.mesh)
    rules = nnxscale.resolve(None, mesh)
    model = nnxscale.sharded_init(lambda: family.build(config, rngs=nnx.Rngs(0)), mesh, rules)
    context = family.dims(config).context
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, args.prompt_len).tolist() for _ in range(args.rows)]
    length = min(context, -(-(args.prompt_len + args.new) // ROUND_TO) * ROUND_TO)
    greedy = Sampling(temperature=0.0)
    print(f"{args.model}: {sum(x.size for x in jax.tree.leaves(nnx.state(model))) / 1e6:.0f}M parameters on {args.mesh} "
          f"({jax.device_count()} {jax.devices()[0].platform} devices); {args.rows} prompts of {args.prompt_len} tokens, "
          f"{args.new} new tokens each, window {length}", flush=True)  # fmt: skip

    cached = Generator(model, context, rules, cache=True)
    _, compile_cached = timed(lambda: cached(prompts, 1, greedy, length=length))  # compiles and runs the prefill
    tokens_cached, t_cached = timed(lambda: cached(prompts, args.new, greedy, length=length))
    print(f"cached:    {t_cached:8.2f} s for {args.new} tokens, {t_cached / args.new * 1e3:7.1f} ms/token "
          f"(first call, compiling: {compile_cached:.1f} s)", flush=True)  # fmt: skip

    recompute = Generator(model, context, rules, cache=False)
    n = args.new if args.full else min(args.recompute_tokens, args.new)
    _, compile_recompute = timed(lambda: recompute(prompts, 1, greedy, length=length))
    tokens_recompute, t_n = timed(lambda: recompute(prompts, n, greedy, length=length))
    t_recompute = t_n * args.new / n
    how = "timed" if n == args.new else f"{t_n:.2f} s timed over {n} tokens, scaled to {args.new}"
    print(f"recompute: {t_recompute:8.2f} s for {args.new} tokens, {t_recompute / args.new * 1e3:7.1f} ms/token ({how}; "
          f"first call, compiling: {compile_recompute:.1f} s)", flush=True)  # fmt: skip

    same = all(a[:n] == b[:n] for a, b in zip(tokens_cached, tokens_recompute))
    print(f"greedy tokens equal over the first {n}: {same}")
    print(json.dumps({
        "cached_over_recompute": round(t_recompute / t_cached, 1), "cached_s": round(t_cached, 2),
        "recompute_s": round(t_recompute, 2), "recompute_timed_tokens": n, "new_tokens": args.new,
        "prompt_tokens": args.prompt_len, "rows": args.rows, "mesh": args.mesh, "model": args.model, "same_tokens": same,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
