"""Long sequences: the training step's memory against the sequence length, at real sizes.

Compiles nnxscale's real train step ahead of time (nothing allocated) on 8 simulated CPU
devices and reads the compiler's memory analysis:

- llama-3.2-1b, ``fsdp=8``, ``--remat full``, global batch 8 (one sequence per device),
  float32, at T = 4,096 and 16,384: activations and temporaries (the compiled step's temp
  bytes), with today's defaults (``--attention auto``: blockwise from 2,048 tokens; the
  chunked loss) and with the baseline in the same run (``--attention xla`` and the loss
  over all logits at once, as before the long-sequence work);
- at T <= 1,024 the defaults pick XLA's attention and one loss chunk, the same program
  as the baseline: the step time of gpt2-mini at 8 x 256 (its context) on ``data=8`` (run,
  the best of 6 steps) against the baseline's.

- T = 131,072 with the sequence split over a ``context`` axis of 8: llama-3.2-1b at batch 1
  on ``context=8`` and llama-3.1-8b at global batch 1 on ``context=8``, ``--remat full``:
  the compiled peak per device.

Prints a table and last one JSON line:
``{"temp_16k_over_4k", "peak_128k_context8_gib", "peak_8b_128k_gib", "short_seq_step_time_ratio"}``
(targets: <= 4.5, <= 16, <= 80, <= 1.1).

    python bench/long_context.py
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from nnxscale.layers import loss as losslib  # noqa: E402
from nnxscale.layers import mlp_chunks  # noqa: E402
from nnxscale.sharding.layout import format_bytes  # noqa: E402
from nnxscale.training.config import TrainConfig  # noqa: E402
from nnxscale.training.state import init_state, setup  # noqa: E402
from nnxscale.training.step import make_train_step  # noqa: E402

GIB = 1 << 30


@contextlib.contextmanager
def baseline():
    """The step as it was before: XLA's attention (set per config), one loss chunk, the MLP
    over every token at once."""
    saved = losslib.CHUNK_BYTES, mlp_chunks.CHUNK_BYTES
    losslib.CHUNK_BYTES = mlp_chunks.CHUNK_BYTES = 1 << 62
    try:
        yield
    finally:
        losslib.CHUNK_BYTES, mlp_chunks.CHUNK_BYTES = saved


def compiled_memory(cfg: TrainConfig):
    s = setup(cfg)
    t = time.perf_counter()
    with jax.set_mesh(s.mesh):
        compiled = make_train_step(s).lower(s.abstract, s.abstract_batch).compile()
    return compiled.memory_analysis(), time.perf_counter() - t


def step_seconds(cfg: TrainConfig, steps: int = 6) -> float:
    """The fastest of ``steps`` runs of the real step on a fixed batch."""
    s = setup(cfg)
    state = init_state(s)
    rng = np.random.default_rng(0)
    batch = {
        k: jax.device_put(rng.integers(0, 256, v.shape).astype(v.dtype), v.sharding) for k, v in s.abstract_batch.items()
    }
    step = make_train_step(s)
    best = float("inf")
    with jax.set_mesh(s.mesh):
        for _ in range(steps):
            t = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    print("llama-3.2-1b, fsdp=8, --remat full, global batch 8, float32, 8 CPU devices (compiled, not run)")
    print(f"{'':28}{'T':>8}{'temp / device':>16}{'peak / device':>16}{'compile s':>11}")
    temps = {}
    for name, attention, ctx in (("baseline (xla, whole loss)", "xla", baseline), ("nnxscale (auto)", "auto", contextlib.nullcontext)):
        for T in (4096, 16384):
            cfg = TrainConfig.from_flags(model="llama-3.2-1b", mesh="fsdp=8", remat="full", batch_size=8, seq_len=T,
                                         attention=attention)  # fmt: skip
            with ctx():
                ma, secs = compiled_memory(cfg)
            peak = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
            temps[name, T] = ma.temp_size_in_bytes
            print(f"{name:28}{T:>8,}{format_bytes(ma.temp_size_in_bytes):>16}{format_bytes(peak):>16}{secs:>11.1f}")
    for name in ("baseline (xla, whole loss)", "nnxscale (auto)"):
        print(f"  {name}: 16k / 4k temporaries {temps[name, 16384] / temps[name, 4096]:.2f}x")

    print("T = 131,072 on context=8, --remat full, batch 1 (compiled, not run)")
    peaks = {}
    for model in ("llama-3.2-1b", "llama-3.1-8b"):
        cfg = TrainConfig.from_flags(model=model, mesh="context=8", remat="full", batch_size=1, seq_len=131072)
        ma, secs = compiled_memory(cfg)
        peaks[model] = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
        print(f"  {model:14}peak {format_bytes(peaks[model]):>11}, temporaries {format_bytes(ma.temp_size_in_bytes):>11}, "
              f"compiled in {secs:.0f} s")  # fmt: skip

    print("gpt2-mini, data=8, global batch 8 x 256 (run): step time, best of 6")
    short = TrainConfig.from_flags(model="gpt2-mini", mesh="data=8", batch_size=8, seq_len=256)
    with baseline():
        base = step_seconds(TrainConfig.from_flags(model="gpt2-mini", mesh="data=8", batch_size=8, seq_len=256,
                                                   attention="xla"))  # fmt: skip
    ours = step_seconds(short)
    print(f"  baseline {base * 1000:.1f} ms, nnxscale {ours * 1000:.1f} ms")
    print(json.dumps({
        "temp_16k_over_4k": round(temps["nnxscale (auto)", 16384] / temps["nnxscale (auto)", 4096], 3),
        "temp_16k_gib": round(temps["nnxscale (auto)", 16384] / GIB, 3),
        "baseline_temp_16k_over_4k": round(temps["baseline (xla, whole loss)", 16384] / temps["baseline (xla, whole loss)", 4096], 3),
        "peak_128k_context8_gib": round(peaks["llama-3.2-1b"] / GIB, 3),
        "peak_8b_128k_gib": round(peaks["llama-3.1-8b"] / GIB, 3),
        "short_seq_step_time_ratio": round(ours / base, 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
