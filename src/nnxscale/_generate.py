"""Sample text from a trained run (byte-level models: tokens are bytes)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxscale._checkpoint import Checkpointer, checkpoint_dir
from nnxscale._config import MAX_SEED, ConfigError, TrainConfig, with_overrides
from nnxscale._mesh import make_mesh
from nnxscale._train import saved_config, setup


def load_model(run_dir, *, warn: Callable[[str], None] = print) -> nnx.Module:
    """The model of a run's newest intact checkpoint, on one device (of this process, in a job).

    Damaged newer checkpoints are skipped, each with a ``warn`` line.
    """
    run_dir = Path(run_dir)
    saved = saved_config(run_dir)
    if saved is None:
        raise ConfigError(f"{run_dir} is not an nnxscale run directory (no config.json)")
    cfg = TrainConfig.from_dict(saved)
    s = setup(with_overrides(cfg, {"mesh": "data=1"}), mesh=make_mesh("data=1", devices=jax.local_devices()[:1]))
    with Checkpointer(checkpoint_dir(run_dir), async_save=False) as ckpt:
        _, state, _ = ckpt.restore_intact(s.abstract, warn=warn)
    return nnx.merge(s.graphdef, state["params"])


def sample(
    run_dir, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40, seed: int = 0,
    warn: Callable[[str], None] = print,
) -> str:  # fmt: skip
    """Continue ``prompt`` with ``max_new_tokens`` sampled bytes; returns prompt + continuation."""
    if max_new_tokens < 1 or not 0 <= temperature < math.inf or top_k < 0 or not 0 <= seed <= MAX_SEED:
        raise ConfigError(
            f"--max-new-tokens must be positive (got {max_new_tokens}), --temperature finite and non-negative "
            f"(got {temperature}), --top-k non-negative (got {top_k}), --seed in [0, {MAX_SEED}] (got {seed})"
        )
    model = load_model(run_dir, warn=warn)
    cfg = model.config
    if cfg.vocab_size > 256:
        raise ConfigError(f"sample decodes byte-level models (vocab 256); this model has vocab {cfg.vocab_size}")
    context = cfg.n_positions
    graphdef, params = nnx.split(model)

    @jax.jit
    def next_logits(params, window, length):
        logits = nnx.merge(graphdef, params)(window[None, :])[0]  # (T, V)
        return logits[length - 1]

    tokens = list(prompt.encode("utf-8")) or [10]
    key = jax.random.key(seed)
    for _ in range(max_new_tokens):
        ctx = tokens[-context:]
        window = np.zeros(context, np.int32)
        window[: len(ctx)] = ctx
        logits = next_logits(params, jnp.asarray(window), jnp.int32(len(ctx)))
        if temperature == 0:
            nxt = int(jnp.argmax(logits))
        else:
            logits = logits / temperature
            if top_k:
                kth = jnp.sort(logits)[-min(top_k, logits.shape[-1])]
                logits = jnp.where(logits < kth, -jnp.inf, logits)
            key, sub = jax.random.split(key)
            nxt = int(jax.random.categorical(sub, logits))
        tokens.append(nxt)
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
