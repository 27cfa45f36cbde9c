"""GPT-2: published sizes, the Hugging Face checkpoint layout, a numpy reference, and the
same logits on every mesh."""

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import gpt2_reference
import nnxscale
from model_testing import counts_by_depth, jit_logits, params_by_path, randomize, rules_for, sharded_logits
from nnxscale.models.gpt2 import GPT2, PRESETS, GPT2Config, from_pretrained, preset, save_pretrained
from nnxscale.sharding.rules import batch_spec

TINY = preset("gpt2-tiny")  # vocab 256, 2 layers, 8 heads, 64 wide, context 128

# Published GPT-2 sizes (tied embedding, vocab 50257, context 1024).
PUBLISHED = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}


def hf_gpt2_shapes(cfg: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of HF's GPT2Model, as its modules define them (Conv1D: (in, out))."""
    V, P, C = cfg.vocab_size, cfg.n_positions, cfg.n_embd
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        shapes |= {
            p + "ln_1.weight": (C,), p + "ln_1.bias": (C,),
            p + "attn.c_attn.weight": (C, 3 * C), p + "attn.c_attn.bias": (3 * C,),
            p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
            p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
            p + "mlp.c_fc.weight": (C, 4 * C), p + "mlp.c_fc.bias": (4 * C,),
            p + "mlp.c_proj.weight": (4 * C, C), p + "mlp.c_proj.bias": (C,),
        }  # fmt: skip
    return shapes


@pytest.fixture(scope="module")
def tokens():
    return np.asarray(jax.random.randint(jax.random.key(1), (8, 16), 0, TINY.vocab_size), np.int32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokens):
    """A randomized tiny model saved with save_pretrained, and its float32 logits."""
    model = randomize(GPT2(TINY, rngs=nnx.Rngs(0)))
    path = tmp_path_factory.mktemp("gpt2") / "tiny"
    save_pretrained(model, path)
    return path, model, jit_logits(model, tokens)


# ---------------------------------------------------------------------------- 1. sizes


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_parameter_counts(name):
    cfg = PRESETS[name]
    _, whole = counts_by_depth(lambda c: GPT2(c, rngs=nnx.Rngs(0)), cfg, "n_layer")
    assert whole == PUBLISHED[name]
    assert cfg.num_params() == PUBLISHED[name]
    assert (cfg.vocab_size, cfg.n_positions) == (50257, 1024)


def test_flops_per_token_follows_nanogpt():
    cfg = PRESETS["gpt2"]
    n = 124_439_808 - 1024 * 768  # nanoGPT's "123.65M": position embedding excluded
    assert cfg.flops_per_token(1024) == 6 * n + 12 * 12 * 768 * 1024


@pytest.mark.parametrize("name", ["gpt2-tiny", "gpt2-mini"])
def test_byte_presets_split_eight_ways(name):
    cfg = PRESETS[name]
    assert cfg.vocab_size == 256
    assert cfg.n_head % 8 == 0 and cfg.n_embd % 8 == 0 and cfg.vocab_size % 8 == 0
    leaves = jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: GPT2(cfg, rngs=nnx.Rngs(0)))))
    assert sum(math.prod(x.shape) for x in leaves) == cfg.num_params()


def test_state_is_params_only_with_logical_axes():
    model = nnx.eval_shape(lambda: GPT2(preset("gpt2-tiny", dropout=0.1), rngs=nnx.Rngs(0)))
    variables = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert variables and all(type(v) is nnx.Param for v in variables)
    for v in variables:
        names = v.get_metadata()["logical_axes"]
        assert len(names) == len(v.get_value().shape)
        assert set(names) <= {"layers", "embed", "mlp", "heads", "kv", "vocab", None}
        assert "out_sharding" not in v.get_metadata() or v.get_metadata()["out_sharding"] is None
    # the blocks are stacked: a leading layers axis on every block parameter, nowhere else
    attn = model.h.attn
    assert attn.c_attn.kernel.get_metadata()["logical_axes"] == ("layers", "embed", None, "heads", "kv")
    assert attn.c_proj.kernel.get_metadata()["logical_axes"] == ("layers", "heads", "kv", "embed")
    assert attn.c_attn.kernel.get_value().shape == (TINY.n_layer, 64, 3, 8, 8)
    assert model.wte.embedding.get_metadata()["logical_axes"] == ("vocab", "embed")
    assert model.ln_f.scale.get_metadata()["logical_axes"] == ("embed",)


# ------------------------------------------------------------------- 2. HF layout


def test_save_pretrained_writes_hf_layout(checkpoint):
    path, _, _ = checkpoint
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == hf_gpt2_shapes(TINY)
    config = json.loads((path / "config.json").read_text())
    expected = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256, "n_positions": 128,
        "n_ctx": 128, "n_embd": 64, "n_layer": 2, "n_head": 8, "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new", "initializer_range": 0.02,
    }  # fmt: skip
    assert {k: config[k] for k in expected} == expected
    assert {"resid_pdrop", "embd_pdrop", "attn_pdrop"} <= set(config)


def test_round_trip_is_bit_exact(checkpoint, tokens):
    path, model, logits = checkpoint
    loaded = from_pretrained(path)
    assert loaded.config == model.config
    before, after = params_by_path(model), params_by_path(loaded)
    assert before.keys() == after.keys()
    for k in before:
        assert after[k].dtype == np.float32 and np.array_equal(before[k], after[k]), k
    np.testing.assert_array_equal(jit_logits(loaded, tokens), logits)


def test_round_trip_keeps_bfloat16_params(checkpoint, tmp_path):
    _, model, _ = checkpoint
    cfg = dataclasses.replace(model.config, param_dtype="bfloat16")
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GPT2(cfg, rngs=nnx.Rngs(0))))
    bf16 = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model)))
    save_pretrained(bf16, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    loaded = from_pretrained(tmp_path)
    assert loaded.config == cfg
    before, after = params_by_path(bf16), params_by_path(loaded)
    for k in before:
        assert after[k].dtype == jnp.bfloat16 and np.array_equal(before[k], after[k]), k


def test_from_pretrained_accepts_prefixed_keys_tied_head_and_buffers(checkpoint, tmp_path, tokens):
    path, _, expected = checkpoint
    tensors = {"transformer." + k: v for k, v in load_file(str(path / "model.safetensors")).items()}
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"]
    P = TINY.n_positions
    for i in range(TINY.n_layer):  # the causal-mask buffers older HF checkpoints carry
        tensors[f"transformer.h.{i}.attn.bias"] = np.tril(np.ones((P, P), np.float32))[None, None]
        tensors[f"transformer.h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    np.testing.assert_array_equal(jit_logits(from_pretrained(tmp_path), tokens), expected)


def _rewrite(src, dst, edit):
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_from_pretrained_errors(checkpoint, tmp_path):
    path, _, _ = checkpoint
    with pytest.raises(FileNotFoundError, match="nowhere"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(tmp_path / "empty")

    def case(name, edit):
        (tmp_path / name).mkdir()
        return _rewrite(path, tmp_path / name, edit)

    with pytest.raises(ValueError, match=r"h\.1\.mlp\.c_fc\.bias"):
        from_pretrained(case("missing", lambda t: t.pop("h.1.mlp.c_fc.bias")))
    with pytest.raises(ValueError, match=r"h\.0\.attn\.c_attn\.weight.*\(64, 190\).*\(64, 192\)"):
        from_pretrained(case("shape", lambda t: t.update({"h.0.attn.c_attn.weight": np.zeros((64, 190), np.float32)})))
    with pytest.raises(ValueError, match=r"h\.2\.ln_1\.weight"):
        from_pretrained(case("extra", lambda t: t.update({"h.2.ln_1.weight": np.ones(64, np.float32)})))
    with pytest.raises(ValueError, match="lm_head.weight"):
        from_pretrained(case("untied", lambda t: t.update({"lm_head.weight": t["wte.weight"] + 1})))
    relu = case("relu", lambda t: None)
    hf_config = json.loads((path / "config.json").read_text())
    (relu / "config.json").write_text(json.dumps({**hf_config, "activation_function": "relu"}))
    with pytest.raises(ValueError, match="activation_function='relu' is not supported"):
        from_pretrained(relu)


# ---------------------------------------------------------- 3. numpy reference


def test_logits_match_numpy_reference(checkpoint, tokens):
    path, _, logits = checkpoint
    config, params = gpt2_reference.load(path)
    expected = gpt2_reference.logits(config, params, tokens)
    assert np.abs(expected).max() > 1.0  # randomized weights: the comparison is not all zeros
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jit_logits(from_pretrained(path), tokens), expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------- 4. every mesh

# mesh -> expected per-device shard shapes of (mlp.c_fc.kernel, attn.c_attn.kernel, wte);
# the stacked blocks' leading layers axis (2) is replicated
MESHES = {
    "data=8": ((2, 64, 256), (2, 64, 3, 8, 8), (256, 64)),
    "fsdp=8": ((2, 8, 256), (2, 8, 3, 8, 8), (256, 8)),
    "model=8": ((2, 64, 32), (2, 64, 3, 1, 8), (32, 64)),
    "data=2,model=4": ((2, 64, 64), (2, 64, 3, 2, 8), (64, 64)),
}


def assert_shards(model, mesh, expected):
    arrays = (model.h.mlp.c_fc.kernel, model.h.attn.c_attn.kernel, model.wte.embedding)
    for var, shape in zip(arrays, expected):
        arr = var.get_value()
        assert arr.sharding.mesh.devices.size == mesh.devices.size
        assert {s.data.shape for s in arr.addressable_shards} == {shape}


@pytest.fixture(scope="module")
def one_device_logits(tokens):
    mesh = nnxscale.make_mesh("data=1", devices=jax.devices()[:1])
    model = nnxscale.sharded_init(lambda: GPT2(TINY, rngs=nnx.Rngs(0)), mesh, rules=rules_for(mesh))
    assert_shards(model, mesh, ((2, 64, 256), (2, 64, 3, 8, 8), (256, 64)))
    return sharded_logits(model, mesh, tokens)


@pytest.mark.parametrize("spec", MESHES)
def test_same_logits_on_every_mesh(spec, tokens, one_device_logits):
    mesh = nnxscale.make_mesh(spec)
    model = nnxscale.sharded_init(lambda: GPT2(TINY, rngs=nnx.Rngs(0)), mesh, rules=rules_for(mesh))
    assert_shards(model, mesh, MESHES[spec])
    np.testing.assert_allclose(sharded_logits(model, mesh, tokens), one_device_logits, rtol=1e-5, atol=1e-5)


# mesh -> the layouts the activation rules promise: residual stream, q/k/v, MLP hidden, logits
ACTIVATIONS = {
    "data=8": {("batch", "length", "embed"): P("data", None, None), ("batch", "length", "mlp"): P("data", None, None),
               ("batch", "length", "heads", "kv"): P("data", None, None, None), ("batch", "length", "vocab"): P("data", None, None)},
    "fsdp=8": {("batch", "length", "embed"): P("fsdp", None, None), ("batch", "length", "mlp"): P("fsdp", None, None),
               ("batch", "length", "heads", "kv"): P("fsdp", None, None, None), ("batch", "length", "vocab"): P("fsdp", None, None)},
    "data=2,model=4": {("batch", "length", "embed"): P("data", None, None), ("batch", "length", "mlp"): P("data", None, "model"),
                       ("batch", "length", "heads", "kv"): P("data", None, "model", None),
                       ("batch", "length", "vocab"): P("data", None, "model")},
}  # fmt: skip


@pytest.mark.parametrize("spec", ACTIVATIONS)
def test_activations_take_the_layout_of_the_activation_rules(spec, tokens):
    from nnxscale.sharding.activations import record_activations

    mesh = nnxscale.make_mesh(spec)
    model = nnxscale.sharded_init(lambda: GPT2(TINY, rngs=nnx.Rngs(0)), mesh, rules=rules_for(mesh))
    graphdef, state = nnx.split(model)
    batch = jax.device_put(tokens, NamedSharding(mesh, batch_spec(None, mesh)))

    @jax.jit
    def forward(state, tokens):
        with nnxscale.use_rules(rules_for(mesh)):
            return nnx.merge(graphdef, state)(tokens)

    with record_activations() as records:
        logits = forward(state, batch)
    seen = {r.names: r.layout.spec for r in records}
    assert seen == ACTIVATIONS[spec]
    # the constraint is real: the logits come out in the promised layout
    assert logits.sharding.is_equivalent_to(NamedSharding(mesh, ACTIVATIONS[spec][("batch", "length", "vocab")]), 3)
    # and outside any mesh or rules the model runs unconstrained on one device
    with record_activations() as records:
        GPT2(TINY, rngs=nnx.Rngs(0))(tokens[:1])
    assert records == []


@pytest.mark.parametrize("spec", ["fsdp=8", "data=2,model=4"])
def test_from_pretrained_onto_a_mesh(spec, checkpoint, tokens):
    path, model, logits = checkpoint
    mesh = nnxscale.make_mesh(spec)
    loaded = from_pretrained(path, mesh=mesh, rules=rules_for(mesh))
    assert_shards(loaded, mesh, MESHES[spec])
    expected = params_by_path(model)
    for k, v in params_by_path(loaded).items():
        assert np.array_equal(v, expected[k]), k
    np.testing.assert_allclose(sharded_logits(loaded, mesh, tokens), logits, rtol=1e-5, atol=1e-5)


# ------------------------------------------------- 5. dtype, remat, dropout, errors


def test_bfloat16_compute_is_close_to_float32(checkpoint, tokens):
    path, _, logits = checkpoint
    model = from_pretrained(path, dtype="bfloat16")
    assert model.config.dtype == "bfloat16"
    assert model.wte.embedding.get_value().dtype == jnp.float32  # params stay float32
    out = jit_logits(model, tokens)
    assert out.dtype == np.float32
    err = np.abs(out - logits).max()
    assert 0 < err < 0.03 * np.abs(logits).max(), err  # differs (bf16 really used), but only a little


def _traced_loss_and_grads(cfg, tokens):
    """The traced ``value_and_grad`` of the mean next-token loss, and the state to call it on."""
    graphdef, state = nnx.split(GPT2(cfg, rngs=nnx.Rngs(0)))

    def loss_fn(state):
        logits = nnx.merge(graphdef, state)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    return jax.jit(jax.value_and_grad(loss_fn)).trace(state), state


@functools.cache
def _long_loss_and_grads(cfg):
    """On full-context sequences (long enough that saved activations dominate temporary
    memory): the loss, its gradients and the compiled program's temporary bytes. Keyed by the
    config: a config that normalizes to another's is that one's program, compiled once."""
    loss_and_grads, temp, _ = _long_compiled(cfg)
    return loss_and_grads, temp


@functools.cache
def _long_compiled(cfg):
    """:func:`_long_loss_and_grads` and the compiled program's FLOPs."""
    long_tokens = np.asarray(jax.random.randint(jax.random.key(2), (8, 128), 0, TINY.vocab_size), np.int32)
    traced, state = _traced_loss_and_grads(cfg, long_tokens)
    compiled = traced.lower().compile()
    return compiled(state), compiled.memory_analysis().temp_size_in_bytes, compiled.cost_analysis()["flops"]


def _per_layer(policy):
    """Per layer (4 -> 8 layers): the compiled loss and gradients' temporary bytes under ``policy``."""
    deep, shallow = (_long_compiled(dataclasses.replace(TINY, n_layer=n, remat=policy))[1] for n in (8, 4))
    return (deep - shallow) / 4


#: One (B, T, C) float32 of the programs above: B x T = 8 x 128.
WIDTH = 8 * 128 * TINY.n_embd * 4


@pytest.mark.parametrize("policy, at_most", [("full", 0.8), ("dots", 1.0), ("dots-except-mlp-in", 0.97), (True, 0.8)])
def test_remat_same_loss_and_gradients_less_memory(policy, at_most):
    (loss, grads), temp = _long_loss_and_grads(dataclasses.replace(TINY, n_layer=4))
    cfg = dataclasses.replace(TINY, n_layer=4, remat=policy)
    assert cfg.remat == ("full" if policy is True else policy)
    (loss_r, grads_r), temp_r = _long_loss_and_grads(cfg)
    np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
    for g, g_r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r)):
        np.testing.assert_allclose(g_r, g, rtol=1e-5, atol=1e-7)
    # the compiler's own figures: rematerialization really keeps less for the backward pass
    assert temp_r <= at_most * temp, (policy, temp_r, temp)


def test_remat_none_recomputes_no_product_and_keeps_no_elementwise_intermediate():
    """``none`` keeps per layer what ``dots`` keeps (the weight matmuls' outputs, about 10
    widths: qkv 3C, the attention's projection C, the MLP's 4C and C, the layer's input) and
    runs no more FLOPs than it. A scan without a ``jax.checkpoint`` kept every float32
    intermediate of the norms and the GELU instead: 70 widths per layer here, and on the H100
    compiler 2.4x ``dots``' memory and twice its step (issue 49, docs/steptime.md)."""
    none, dots, full = _per_layer("none"), _per_layer("dots"), _per_layer("full")
    assert none == pytest.approx(dots, rel=0.05), (none, dots, WIDTH)
    assert 8 * WIDTH <= none < 12 * WIDTH, (none / WIDTH)
    assert full < none / 4, (full, none)
    # The compiler's FLOPs (of the 4-layer programs: it counts a loop's body once)
    flops = {p: _long_compiled(dataclasses.replace(TINY, n_layer=4, remat=p))[2] for p in ("none", "dots", "full")}
    assert flops["none"] <= flops["dots"] < flops["full"], flops


def test_dots_except_mlp_in_keeps_what_dots_keeps_but_the_mlp_input_projection():
    # Per layer more (4 -> 8 layers), from the compiler's temporaries: dots keeps each layer's
    # c_fc output (B, T, 4C) beyond what dots-except-mlp-in keeps, which keeps the attention's
    # qkv (3C) and output (C) beyond what full keeps (the layer's input). float32, B x T = 8 x 128.
    dots, lean, full = _per_layer("dots"), _per_layer("dots-except-mlp-in"), _per_layer("full")
    assert dots - lean == pytest.approx(4 * WIDTH, rel=0.05), (dots, lean, WIDTH)
    assert lean - full == pytest.approx(4 * WIDTH, rel=0.05), (lean, full, WIDTH)


def test_the_blocks_run_as_one_scan():
    jaxpr = str(_traced_loss_and_grads(TINY, np.zeros((2, 9), np.int32))[0].jaxpr)  # traced only: nothing compiled
    assert jaxpr.count("scan[") == 2  # one forward scan, one backward scan: not a Python loop of blocks
    deeper = str(_traced_loss_and_grads(dataclasses.replace(TINY, n_layer=6), np.zeros((2, 9), np.int32))[0].jaxpr)
    assert abs(len(deeper) - len(jaxpr)) < 200  # the traced program does not grow with depth


def test_dropout_only_with_rngs(tokens):
    model = GPT2(preset("gpt2-tiny", dropout=0.1), rngs=nnx.Rngs(0))
    plain = jit_logits(GPT2(TINY, rngs=nnx.Rngs(0)), tokens)  # same parameters, no dropout
    np.testing.assert_array_equal(jit_logits(model, tokens), plain)
    np.testing.assert_allclose(np.asarray(model(tokens[:2])), plain[:2], rtol=1e-5, atol=1e-6)  # eager too
    a, b, c = (jit_logits(model, tokens, jax.random.key(seed)) for seed in (1, 1, 2))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, plain, atol=1e-3)
    assert not np.allclose(a, c, atol=1e-3)
    rate0 = GPT2(TINY, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(jit_logits(rate0, tokens, jax.random.key(1)), plain)


def test_errors():
    model = GPT2(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sequence length 129 exceeds.*n_positions=128"):
        model(jnp.zeros((1, 129), jnp.int32))
    with pytest.raises(ValueError, match="unknown GPT-2 preset 'gpt3'.*gpt2-medium.*gpt2-tiny"):
        preset("gpt3")
    with pytest.raises(ValueError, match="n_embd=100 is not divisible by n_head=8"):
        preset("gpt2-tiny", n_embd=100)
    with pytest.raises(ValueError, match="n_layer must be a positive integer"):
        preset("gpt2-tiny", n_layer=0)
    with pytest.raises(ValueError, match="unknown GPT2Config fields"):
        preset("gpt2-tiny", n_embed=64)
    with pytest.raises(ValueError, match="remat must be one of none, full, dots, dots-except-mlp-in"):
        preset("gpt2-tiny", remat="some")


def test_config_dict_round_trip():
    cfg = preset("gpt2-mini", dropout=0.1, dtype="bfloat16", remat=True)
    assert GPT2Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown GPT2Config fields"):
        GPT2Config.from_dict({**cfg.to_dict(), "n_ctx": 256})
