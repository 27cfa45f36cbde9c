"""Host overhead of one training step: nnxscale's step vs a hand-written one vs nnx.jit.

    python bench/step_overhead.py [--steps 300] [--rounds 5] [--chunk 20]

One small model (``gpt2-tiny``: 2 layers, 64 wide, byte vocabulary), sequence 32, global
batch 8, on a ``data=8`` mesh of simulated CPU devices, small so that the host side of a
step (Python, pytree flattening, dispatch) can show. Three steps, all with the same optax
transform (nnxscale's AdamW + warmup/cosine + global-norm clipping), the same parameter
and optimizer-state shardings and one fixed global batch (the first-step losses printed
must agree):

  nnxscale   ``nnxscale.make_train_step(setup(cfg))`` on ``init_state``'s state: a
             ``jax.jit`` over plain dicts of arrays, donating the state.
  hand       what a careful user writes: ``jax.jit`` over the ``nnx.split`` state,
             ``nnx.merge`` inside, ``donate_argnums``, explicit in/out shardings.
  nnx_jit    ``nnx.jit`` over the model and an ``nnx.Optimizer(model, tx, wrt=nnx.Param)``.

Each is warmed up, then timed in rounds of ``--steps`` steps; the rounds are interleaved
(nnxscale, hand, nnx_jit, nnxscale, ...) and each figure is the median over rounds, so a
noisy neighbour on a 2-core machine does not decide the result. Within a round
``jax.block_until_ready`` runs only every ``--chunk`` steps (never per step): with ~100
steps queued, XLA:CPU's in-process all-reduce deadlocks in jaxlib 0.10.2 (rendezvous
timeout, then abort). ``host us/call`` is the time spent inside the step calls; on 8
simulated devices sharing 2 cores much of it is XLA's own work, not Python.
``nnxscale (as train)`` is the same step called as ``nnxscale.train`` calls it,
inside ``jax.set_mesh`` (informational).

The last line is JSON: ``{"nnxscale": ratio, "nnx_jit": ratio}``, each the median step time
over the hand-written step's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from nnxscale.data import tokens as datalib  # noqa: E402
from nnxscale.training.config import TrainConfig, with_overrides  # noqa: E402
from nnxscale.training.state import init_state, setup  # noqa: E402
from nnxscale.training.step import make_train_step  # noqa: E402

MODEL, MESH, SEQ, BATCH = "gpt2-tiny", "data=8", 32, 8


def xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def same_transform(s):
    """``s.tx`` (clip + AdamW + schedule) for the other two steps, with the decay of nnxscale's
    ``s.decay_mask`` (for gpt2: every parameter but the biases and LayerNorm parameters),
    written as a function of paths so that it also serves an ``nnx.State``, whose paths end
    in the Variable's attribute.
    """
    o = s.cfg.optim

    def decay(params):
        def keep(path, _):
            names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
            return str(names[-1]) not in ("bias", "scale")

        return jax.tree_util.tree_map_with_path(keep, params)

    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        optax.adamw(s.schedule, b1=o.beta1, b2=o.beta2, weight_decay=o.weight_decay, mask=decay),
    )


def on_mesh(tree, mesh):
    """Scalars that optax or nnx created on one device (step counts) -> replicated on the mesh."""
    replicated = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: a if len(a.sharding.device_set) > 1 else jax.device_put(a, replicated), tree)


def build():
    cfg = with_overrides(
        TrainConfig(), {"model.name": MODEL, "parallel.mesh": MESH, "data.seq_len": SEQ, "data.batch_size": BATCH, "steps": 10_000}
    )
    s = setup(cfg)
    rows = np.random.default_rng(0).integers(0, 256, size=(BATCH, SEQ + 1), dtype=np.int32)
    batch = datalib.to_global({"inputs": rows[:, :-1].copy(), "targets": rows[:, 1:].copy()}, s.batch_sharding)
    x, y = batch["inputs"], batch["targets"]
    steps = {}

    # (a) nnxscale: the library's own step on the library's own state.
    a_step = make_train_step(s)
    a = {"state": init_state(s)}

    def run_a():
        a["state"], metrics = a_step(a["state"], batch)
        return metrics["loss"]

    def run_a_as_train():
        with jax.set_mesh(s.mesh):
            a["state"], metrics = a_step(a["state"], batch)
        return metrics["loss"]

    steps["nnxscale"] = (run_a, lambda: a["state"])
    steps["nnxscale (as train)"] = (run_a_as_train, lambda: a["state"])

    # The same initial parameters, in the same layout, for the other two.
    def fresh_model():
        return nnx.merge(s.graphdef, init_state(s)["params"])

    tx = same_transform(s)

    # (b) hand-written functional step.
    graphdef, params = nnx.split(fresh_model())
    p_sh = jax.tree.map(lambda v: v.sharding, params)
    opt_state = on_mesh(jax.jit(tx.init)(params), s.mesh)
    o_sh = jax.tree.map(lambda v: v.sharding, opt_state)
    b_sh = s.batch_sharding

    def hand_step(params, opt_state, x, y):
        def loss_fn(p):
            return xent(nnx.merge(graphdef, p)(x), y)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    hand_jit = jax.jit(
        hand_step, in_shardings=(p_sh, o_sh, b_sh, b_sh), out_shardings=(p_sh, o_sh, None), donate_argnums=(0, 1)
    )
    b = {"params": params, "opt": opt_state}

    def run_b():
        b["params"], b["opt"], loss = hand_jit(b["params"], b["opt"], x, y)
        return loss

    steps["hand"] = (run_b, lambda: b["params"])

    # (c) plain nnx.jit with nnx.Optimizer.
    model = fresh_model()
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    nnx.update(optimizer, on_mesh(nnx.state(optimizer), s.mesh))

    @nnx.jit
    def nnx_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: xent(m(x), y))(model)
        optimizer.update(model, grads)
        return loss

    def run_c():
        return nnx_step(model, optimizer, x, y)

    steps["nnx_jit"] = (run_c, lambda: nnx.state(model))

    # All three must be the same computation in the same layout: same first loss, and
    # optimizer moments sharded like their parameters.
    check_layouts(a["state"], [params, nnx.state(model)], [opt_state, optimizer.opt_state])
    first = {name: float(fn()) for name, (fn, _) in steps.items() if name != "nnxscale (as train)"}
    return steps, first


def check_layouts(a_state, params_trees, opt_trees):
    """Everyone's parameters and Adam moments are in the layout of nnxscale's parameters."""

    def shard_shapes(tree):
        return [a.addressable_shards[0].data.shape for a in jax.tree.leaves(tree)]

    def adam(tree):
        is_adam = lambda t: isinstance(t, optax.ScaleByAdamState)  # noqa: E731
        (found,) = [x for x in jax.tree.leaves(tree, is_leaf=is_adam) if is_adam(x)]
        return found

    want = shard_shapes(a_state["params"])
    assert shard_shapes(adam(a_state["opt_state"]).mu) == want
    for params, opt in zip(params_trees, opt_trees, strict=True):
        assert shard_shapes(params) == want, "parameters not in nnxscale's layout"
        assert shard_shapes(adam(opt).mu) == want, "Adam moments not sharded like the parameters"
        assert shard_shapes(adam(opt).nu) == want, "Adam moments not sharded like the parameters"


def time_rounds(steps, n_steps: int, rounds: int, warmup: int, chunk: int):
    """Per step function: (end-to-end seconds per step, host seconds per call), per round.

    The steps of a round run in chunks of ``chunk`` with one ``jax.block_until_ready`` at
    the end of each chunk: with ~100 steps queued, XLA:CPU's in-process all-reduce
    deadlocks (rendezvous timeout, abort) in jaxlib 0.10.2.
    """
    for fn, out in steps.values():
        for _ in range(warmup):
            fn()
        jax.block_until_ready(out())
    wall = {name: [] for name in steps}
    host = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (fn, out) in steps.items():
            in_calls = 0.0
            t0 = time.perf_counter()
            for done in range(0, n_steps, chunk):
                for _ in range(min(chunk, n_steps - done)):
                    t = time.perf_counter()
                    fn()
                    in_calls += time.perf_counter() - t
                jax.block_until_ready(out())
            wall[name].append((time.perf_counter() - t0) / n_steps)
            host[name].append(in_calls / n_steps)
    return wall, host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per step function")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--chunk", type=int, default=20, help="steps between block_until_ready (see time_rounds)")
    args = ap.parse_args()

    steps, first = build()
    times, host = time_rounds(steps, args.steps, args.rounds, args.warmup, args.chunk)
    med = {name: statistics.median(t) for name, t in times.items()}
    host_med = {name: statistics.median(t) for name, t in host.items()}
    base = med["hand"]

    print(f"{MODEL}, seq {SEQ}, batch {BATCH}, mesh {MESH} ({jax.device_count()} {jax.devices()[0].platform} devices); "
          f"{args.rounds} rounds x {args.steps} steps (synced every {args.chunk}), median of rounds")  # fmt: skip
    print("first-step loss: " + ", ".join(f"{k} {v:.5f}" for k, v in first.items()))
    print(f"{'step':<22}{'median us/step':>15}{'min':>10}{'max':>10}{'vs hand':>9}{'host us/call':>14}")
    for name, t in times.items():
        print(f"{name:<22}{med[name] * 1e6:>15.0f}{min(t) * 1e6:>10.0f}{max(t) * 1e6:>10.0f}{med[name] / base:>9.2f}"
              f"{host_med[name] * 1e6:>14.0f}")  # fmt: skip
    print(json.dumps({"nnxscale": round(med["nnxscale"] / base, 2), "nnx_jit": round(med["nnx_jit"] / base, 2)}))


if __name__ == "__main__":
    main()
