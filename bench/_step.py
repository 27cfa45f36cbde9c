"""What the timing benchmarks share: one real train step, ready to time."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nnxscale.training.config import TrainConfig
from nnxscale.training.state import init_state, setup
from nnxscale.training.step import make_train_step


def prepared_step(cfg: TrainConfig):
    """``run()``: one train step of ``cfg`` on real arrays (a fixed random batch of byte
    tokens, the same for every config of that shape), waited for."""
    s = setup(cfg)
    d = cfg.data
    tokens = jax.random.randint(jax.random.key(0), (d.batch_size, d.seq_len), 0, 256, jnp.int32)
    batch = {k: jax.device_put(tokens, s.batch_sharding) for k in ("inputs", "targets")}
    step, box = make_train_step(s), {"state": init_state(s)}

    def run():
        with jax.set_mesh(s.mesh):
            box["state"], metrics = step(box["state"], batch)
        jax.block_until_ready(metrics)

    return run
