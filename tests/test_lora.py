"""LoRA: fresh adapters leave the base's logits exact; adapters laid out like their layers;
only adapters train (the base frozen, bfloat16 when asked, no optimizer state), the same
losses on data, FSDP + tensor and pipeline meshes; resume over the same base, refused over
another; PEFT and merged exports that agree with the trained model."""

import contextlib
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_cli import run_main
from test_train import flat, quiet_train, tiny_cfg

import nnxscale
from nnxscale.checkpoint.checkpointer import Checkpointer, checkpoint_dir
from nnxscale.layers import lora
from nnxscale.models import FAMILIES, find_preset, llama
from nnxscale.sharding.activations import use_rules
from nnxscale.training.adapters import BASE, split_params
from nnxscale.training.model import lora_spec, with_adapters
from nnxscale.training.rundir import read_metrics
from nnxscale.training.state import init_state, setup
from nnxscale.training.step import make_train_step


def _cfg(model, mesh="data=8", **flags):
    return nnxscale.TrainConfig.from_flags(model=model, mesh=mesh, seq_len=32, batch_size=8, lora_rank=4, **flags)


def test_fresh_adapters_give_the_base_logits_exactly():
    """B starts at zero: a model with fresh adapters computes its base's logits bit for bit
    (jitted, float32); once B is not zero they change (the adapters are live)."""
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
    for name in ("gpt2-tiny", "llama-tiny", "mixtral-tiny"):
        family, config = find_preset(name)
        build = lambda rngs, config=config, family=family: family.build(config, rngs=rngs)  # noqa: E731
        spec = lora_spec(_cfg(name), family)
        base, adapted = build(nnx.Rngs(0)), with_adapters(build, spec)(nnx.Rngs(0))
        assert len(lora.adapted(adapted)) == 4 + (0 if name == "gpt2-tiny" else 3)  # every linear layer of the blocks
        def forward(m, off=False):
            def run(state, x, graphdef=nnx.graphdef(m)):
                with lora.disabled() if off else contextlib.nullcontext():
                    return nnx.merge(graphdef, state)(x)

            return jax.jit(run)

        want = forward(base)(nnx.state(base), tokens)
        run = forward(adapted)
        np.testing.assert_array_equal(run(nnx.state(adapted), tokens), want, err_msg=name)
        for _, _, _, a in lora.adapted(adapted):
            a.b.set_value(jnp.full(a.b.get_value().shape, 0.05, jnp.float32))
        assert not np.allclose(run(nnx.state(adapted), tokens), want, atol=1e-3), name
        # the base with the adapters off, from the same state (a DPO reference under LoRA)
        np.testing.assert_array_equal(forward(adapted, off=True)(nnx.state(adapted), tokens), want, err_msg=name)


@pytest.mark.parametrize("model,mesh", [("llama-mini", "fsdp=2,model=4"), ("mixtral-tiny", "expert=4,data=2")])
def test_adapters_are_laid_out_like_their_layers_and_only_they_train(model, mesh):
    """A's input dimensions are split as the layer's input, B's output as its output, the
    rank whole; the base is stored in bfloat16 with no optimizer state, the adapters and
    their moments float32; the planner counts gradients and moments of the adapters alone."""
    cfg = _cfg(model, mesh, dtype="bfloat16", min_shard_bytes=0)
    s = setup(cfg)
    abstract_model = nnx.merge(s.graphdef, s.model_state)  # Variables over ShapeDtypeStructs with their shardings
    spec = lambda v: tuple(v.get_value().sharding.spec) + (None,) * (v.get_value().ndim - len(v.get_value().sharding.spec))  # noqa: E731
    adapted = lora.adapted(abstract_model)
    assert len(adapted) == 7
    for path, module, name, a in adapted:
        w, lead = spec(getattr(module, name)), a.a.get_value().ndim - a.n_in - 1
        assert spec(a.a) == w[: lead + a.n_in] + (None,), path  # leading and input dimensions as the layer's; rank whole
        assert spec(a.b) == w[:lead] + (None,) + w[lead + a.n_in :], path  # leading and output dimensions as the layer's
    assert any(e is not None for _, _, _, a in adapted for e in spec(a.a) + spec(a.b)), "adapters are split over the mesh"
    abstract = s.abstract
    assert {a.dtype for a in jax.tree.leaves(abstract[BASE]) if a.ndim > 1} == {jnp.dtype("bfloat16")}
    assert {a.dtype for a in jax.tree.leaves(abstract["params"])} == {jnp.dtype("float32")}
    moments = [a for a in jax.tree.leaves(abstract["opt_state"]) if a.ndim > 0]
    assert sorted(a.shape for a in moments) == sorted(2 * [a.shape for a in jax.tree.leaves(abstract["params"])])
    from nnxscale.planning.planner import layout_figures, mesh_sizes

    lay = layout_figures(cfg, mesh_sizes(mesh))
    per_device = lambda t: sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in jax.tree.leaves(t))  # noqa: E731
    assert lay["gradient_bytes"] == per_device(lay["setup"].abstract["params"])
    assert lay["param_bytes"] == lay["gradient_bytes"] + per_device(lay["setup"].abstract[BASE])


STEPS = 20


def _batches(data, n, batch=8, seq=32):
    tokens = np.frombuffer(data.read_bytes(), np.uint8).astype(np.int32)
    rows = tokens[: n * batch * (seq + 1)].reshape(n, batch, seq + 1)
    return [{"inputs": r[:, :-1], "targets": r[:, 1:]} for r in rows]


def test_lora_losses_are_the_same_on_data_fsdp_tensor_and_pipeline_meshes(text_data):
    """llama-mini and mixtral-tiny with adapters on every linear layer, 20 steps on data=8,
    fsdp=2,model=4 and stage=2,data=4: the same losses (1e-5 relative); the adapters move,
    the base does not change by a bit."""
    batches = _batches(text_data, STEPS)
    for model in ("llama-mini", "mixtral-tiny"):
        losses = {}
        for mesh in ("data=8", "fsdp=2,model=4", "stage=2,data=4"):
            extra = {"microbatches": 2} if mesh.startswith("stage") else {}
            s = setup(_cfg(model, mesh, min_shard_bytes=0, lr=1e-2, warmup_steps=2, steps=STEPS, **extra))
            state = init_state(s)
            base0, adapters0 = jax.device_get(state[BASE]), jax.device_get(state["params"])
            step = make_train_step(s)
            got = []
            with jax.set_mesh(s.mesh):
                for b in batches:
                    state, metrics = step(state, jax.device_put(b, s.batch_sharding))
                    got.append(float(metrics["loss"]))
            losses[mesh] = got
            jax.tree.map(np.testing.assert_array_equal, jax.device_get(state[BASE]), base0)  # frozen, bit for bit
            moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), jax.device_get(state["params"]), adapters0)
            assert all(jax.tree.leaves(moved)), f"{model} {mesh}: every adapter trains"
        want = losses["data=8"]
        assert want[-1] < want[0] - 0.05, f"{model} learns: {want[0]:.3f} -> {want[-1]:.3f}"
        for mesh, got in losses.items():
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{model} on {mesh}")
