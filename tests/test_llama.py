"""Llama: published sizes, the Hugging Face checkpoint layout (one file and a sharded
index), a numpy reference, and the same logits on every mesh, with K/V heads split by
tensor parallelism when the model axis divides them and replicated when it does not."""

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import llama_reference
import nnxscale
from model_testing import jit_logits, params_by_path, randomize, rules_for, sharded_logits
from nnxscale.sharding.activations import record_activations
from nnxscale.models.llama import PRESETS, Llama, LlamaConfig, RopeScaling, from_pretrained, preset, rope_frequencies, save_pretrained
from nnxscale.sharding.rules import batch_spec

# llama-tiny: vocab 256, 2 layers, 128 wide, 16 query heads sharing 8 K/V heads (8 wide), tied.
TINY = preset("llama-tiny")
# GQA: 8 query heads on 2 K/V heads, heads 16 wide (more than hidden/heads: head_dim set),
# an untied head, and Llama 3 rope scaling whose three frequency bands all occur at head
# width 16 (wavelengths 6.3 kept, 19.9 interpolated, 62.8 and longer stretched).
GQA = preset(
    "llama-tiny", hidden_size=64, intermediate_size=160, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
    tie_word_embeddings=False, rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=32),
)  # fmt: skip

PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
             "llama-3.1-70b": 70_553_706_496}


def hf_llama_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of HF's LlamaForCausalLM, as its modules define them (Linear: (out, in))."""
    V, C, F = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_size, cfg.num_key_value_heads * cfg.head_size
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, C)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
            p + "self_attn.q_proj.weight": (q, C), p + "self_attn.k_proj.weight": (kv, C),
            p + "self_attn.v_proj.weight": (kv, C), p + "self_attn.o_proj.weight": (C, q),
            p + "mlp.gate_proj.weight": (F, C), p + "mlp.up_proj.weight": (F, C), p + "mlp.down_proj.weight": (C, F),
        }  # fmt: skip
    return shapes


@pytest.fixture(scope="module")
def tokens():
    return np.asarray(jax.random.randint(jax.random.key(1), (8, 16), 0, 256), np.int32)


def _checkpoint(tmp_path_factory, tokens, cfg, name):
    model = randomize(Llama(cfg, rngs=nnx.Rngs(0)))
    path = tmp_path_factory.mktemp("llama") / name
    save_pretrained(model, path)
    return path, model, jit_logits(model, tokens)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokens):
    """A randomized GQA model (untied, scaled rope) saved with save_pretrained, and its logits."""
    return _checkpoint(tmp_path_factory, tokens, GQA, "gqa")


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory, tokens):
    return _checkpoint(tmp_path_factory, tokens, TINY, "tiny")


@pytest.fixture(scope="module")
def sharded_checkpoint(checkpoint, tmp_path_factory):
    """The GQA checkpoint written as several files and an index (HF's layout past max_shard_size)."""
    _, model, _ = checkpoint
    path = tmp_path_factory.mktemp("llama") / "sharded"
    save_pretrained(model, path, max_shard_bytes=60_000)
    return path


# ---------------------------------------------------------------------------- 1. sizes


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_parameter_counts(name):
    cfg = PRESETS[name]
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(abstract))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
    assert sum(math.prod(x.shape) for x in leaves) == PUBLISHED[name]
    assert cfg.num_params() == PUBLISHED[name]
    assert (cfg.vocab_size, cfg.num_key_value_heads, cfg.head_size) == (128256, 8, 64 if name == "llama-3.2-1b" else 128)
    untied = name in ("llama-3.1-8b", "llama-3.1-70b")  # the 3.2 models tie the head to the embedding
    assert cfg.tie_word_embeddings == (not untied)
    assert hasattr(abstract, "lm_head") == untied


def test_flops_per_token():
    cfg = PRESETS["llama-3.1-8b"]  # untied: the input embedding is a lookup, no FLOPs
    n = 8_030_261_248 - 128256 * 4096
    assert cfg.flops_per_token(8192) == 6 * n + 12 * 32 * 32 * 128 * 8192
    tied = PRESETS["llama-3.2-1b"]  # tied: the matrix counts once, as the output head
    assert tied.flops_per_token(2048) == 6 * 1_235_814_400 + 12 * 16 * 32 * 64 * 2048


@pytest.mark.parametrize("name", ["llama-tiny", "llama-mini"])
def test_byte_presets_split_eight_ways(name):
    cfg = PRESETS[name]
    assert cfg.vocab_size == 256 and cfg.tie_word_embeddings
    dims = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert all(d % 8 == 0 for d in dims), dims
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # grouped-query attention
    leaves = jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))))
    assert sum(math.prod(x.shape) for x in leaves) == cfg.num_params()


def test_state_is_params_only_with_logical_axes():
    model = nnx.eval_shape(lambda: Llama(dataclasses.replace(GQA, dropout=0.1), rngs=nnx.Rngs(0)))
    variables = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert variables and all(type(v) is nnx.Param for v in variables)
    for v in variables:
        names = v.get_metadata()["logical_axes"]
        assert len(names) == len(v.get_value().shape)
        assert set(names) <= {"layers", "embed", "mlp", "heads", "kv_heads", "kv", "vocab"}
    attn, L = model.layers.self_attn, GQA.num_hidden_layers
    assert attn.q_proj.kernel.get_metadata()["logical_axes"] == ("layers", "embed", "heads", "kv")
    assert attn.k_proj.kernel.get_metadata()["logical_axes"] == ("layers", "embed", "kv_heads", "kv")
    assert attn.o_proj.kernel.get_metadata()["logical_axes"] == ("layers", "heads", "kv", "embed")
    assert attn.k_proj.kernel.get_value().shape == (L, 64, 2, 16)
    assert model.layers.mlp.down_proj.kernel.get_metadata()["logical_axes"] == ("layers", "mlp", "embed")
    assert model.lm_head.kernel.get_metadata()["logical_axes"] == ("embed", "vocab")
    assert model.norm.scale.get_metadata()["logical_axes"] == ("embed",)


def test_rope_frequencies_follow_hf_llama3_scaling():
    for name in ("llama-3.1-8b", "llama-3.2-1b"):
        cfg = PRESETS[name]
        hf = {"hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads, "rope_theta": cfg.rope_theta,
              "rope_scaling": dataclasses.asdict(cfg.rope_scaling)}  # fmt: skip
        ours = rope_frequencies(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)
        np.testing.assert_allclose(ours, llama_reference.inv_frequencies(hf), rtol=1e-12)
        plain = rope_frequencies(cfg.head_size, cfg.rope_theta, None)
        assert ours[0] == plain[0] and ours[-1] == plain[-1] / cfg.rope_scaling.factor  # kept / stretched
        assert ((ours < plain) & (ours > plain / cfg.rope_scaling.factor)).any()  # and interpolated between


# ------------------------------------------------------------------- 2. HF layout


def test_save_pretrained_writes_hf_layout(checkpoint, tied_checkpoint):
    for (path, _, _), cfg in ((checkpoint, GQA), (tied_checkpoint, TINY)):
        with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert shapes == hf_llama_shapes(cfg)
    config = json.loads((checkpoint[0] / "config.json").read_text())
    expected = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32},
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "float32",
    }  # fmt: skip
    assert {k: config[k] for k in expected} == expected


def test_round_trip_is_bit_exact(checkpoint, sharded_checkpoint, tokens):
    path, model, logits = checkpoint
    files = sorted(p.name for p in sharded_checkpoint.iterdir())
    assert files[0] == "config.json" and files[-1] == "model.safetensors.index.json" and len(files) > 4, files
    index = json.loads((sharded_checkpoint / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf_llama_shapes(GQA))
    assert index["metadata"]["total_size"] == 4 * GQA.num_params()
    before = params_by_path(model)
    for where in (path, sharded_checkpoint):
        loaded = from_pretrained(where)
        assert loaded.config == model.config
        after = params_by_path(loaded)
        assert before.keys() == after.keys()
        for k in before:
            assert after[k].dtype == np.float32 and np.array_equal(before[k], after[k]), (where, k)
        np.testing.assert_array_equal(jit_logits(loaded, tokens), logits)


def test_round_trip_keeps_bfloat16_params(tied_checkpoint, tmp_path):
    _, model, _ = tied_checkpoint
    cfg = dataclasses.replace(model.config, param_dtype="bfloat16")
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    bf16 = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model)))
    save_pretrained(bf16, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = from_pretrained(tmp_path)
    assert loaded.config == cfg
    before, after = params_by_path(bf16), params_by_path(loaded)
    for k in before:
        assert after[k].dtype == jnp.bfloat16 and np.array_equal(before[k], after[k]), k


def test_from_pretrained_accepts_unprefixed_keys_tied_head_and_rotary_buffers(tied_checkpoint, tmp_path, tokens):
    path, _, expected = tied_checkpoint
    tensors = {k.removeprefix("model."): v for k, v in load_file(str(path / "model.safetensors")).items()}
    tensors["lm_head.weight"] = tensors["embed_tokens.weight"]  # a tied head written out
    for i in range(TINY.num_hidden_layers):  # the buffer older checkpoints carry
        tensors[f"layers.{i}.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    np.testing.assert_array_equal(jit_logits(from_pretrained(tmp_path), tokens), expected)


def _copy(src, dst, edit=lambda t: None, config=lambda c: c):
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config(json.loads((src / "config.json").read_text()))))
    return dst


def test_from_pretrained_errors(checkpoint, tied_checkpoint, sharded_checkpoint, tmp_path):
    path, tied = checkpoint[0], tied_checkpoint[0]
    with pytest.raises(FileNotFoundError, match="nowhere"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(tmp_path / "empty")
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        from_pretrained(tmp_path / "no-weights")

    with pytest.raises(ValueError, match=r"lacks the tensors \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        from_pretrained(_copy(path, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")))
    with pytest.raises(ValueError, match=r"lacks the tensors \['lm_head\.weight'\]"):  # untied needs its head
        from_pretrained(_copy(path, tmp_path / "no-head", lambda t: t.pop("lm_head.weight")))
    with pytest.raises(ValueError, match=r"does not use: \['model\.layers\.2\.input_layernorm\.weight'\]"):
        from_pretrained(_copy(path, tmp_path / "extra", lambda t: t.update({"model.layers.2.input_layernorm.weight": np.ones(64, np.float32)})))
    bad = np.zeros((30, 64), np.float32)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(30, 64\).*expects \(32, 64\)"):
        from_pretrained(_copy(path, tmp_path / "shape", lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": bad})))
    with pytest.raises(ValueError, match="lm_head.weight' differs from the token embedding.*tie_word_embeddings"):
        from_pretrained(_copy(tied, tmp_path / "untied", lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1})))
    unsupported = [
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias=True is not supported"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type='dynamic' is not supported"),
        ({"attention_bias": True}, "lacks the tensors.*self_attn.k_proj.bias"),  # supported: its biases must be there
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling needs exactly the fields.*missing.*low_freq_factor"),
        ({"model_type": "mistral"}, "model_type='mistral'.*Llama"),
        ({"num_attention_heads": 7}, "num_attention_heads=7 is not a multiple of num_key_value_heads=2"),
    ]
    for i, (change, message) in enumerate(unsupported):
        with pytest.raises(ValueError, match=message):
            from_pretrained(_copy(path, tmp_path / f"config{i}", config=lambda c: {**c, **change}))
    # a sharded set: a file the index names must exist; a stale single file next to it is refused
    broken = tmp_path / "sharded"
    broken.mkdir()
    for p in sharded_checkpoint.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    (broken / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="both model.safetensors and model.safetensors.index.json"):
        from_pretrained(broken)
    (broken / "model.safetensors").unlink()
    second = sorted(set(json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (broken / second).unlink()
    with pytest.raises(FileNotFoundError, match=f"{second} does not exist, but .*index.json names it"):
        from_pretrained(broken)


# ---------------------------------------------------------- 3. numpy reference


@pytest.mark.parametrize("which", ["checkpoint", "tied_checkpoint", "sharded_checkpoint"])
def test_logits_match_numpy_reference(which, request, checkpoint, tokens):
    path = request.getfixturevalue(which)
    path, logits = (path, checkpoint[2]) if which == "sharded_checkpoint" else (path[0], path[2])
    config, params = llama_reference.load(path)
    expected = llama_reference.logits(config, params, tokens)
    assert np.abs(expected).max() > 1.0  # randomized weights: the comparison is not all zeros
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jit_logits(from_pretrained(path), tokens), expected, rtol=1e-5, atol=1e-5)


def test_rope_scaling_changes_the_logits(checkpoint, tokens, tmp_path):
    """The reference agreement above is not blind to the scaling: without it the logits move."""
    path, _, logits = checkpoint
    plain = _copy(path, tmp_path / "plain", config=lambda c: {**c, "rope_scaling": None})
    assert from_pretrained(plain).config.rope_scaling is None
    assert np.abs(jit_logits(from_pretrained(plain), tokens) - logits).max() > 1e-3


# ------------------------------------------------------------- 4. every mesh

# (config, mesh) -> per-device shard shapes of (mlp.gate_proj, self_attn.q_proj, self_attn.k_proj,
# the output head); the stacked layers' leading axis (2) is replicated. TINY's 8 K/V heads
# divide by model=8 and split with their query heads; GQA's 2 do not, and stay whole.
# (data=8, which splits no parameter, is test_gpt2's and every training test's reference.)
MESHES = {
    ("tiny", "fsdp=8"): ((2, 16, 384), (2, 16, 16, 8), (2, 16, 8, 8), (256, 16)),
    ("tiny", "model=8"): ((2, 128, 48), (2, 128, 2, 8), (2, 128, 1, 8), (32, 128)),
    ("tiny", "data=2,model=4"): ((2, 128, 96), (2, 128, 4, 8), (2, 128, 2, 8), (64, 128)),
    ("gqa", "model=8"): ((2, 64, 20), (2, 64, 1, 16), (2, 64, 2, 16), (64, 32)),
    ("gqa", "data=2,model=4"): ((2, 64, 40), (2, 64, 2, 16), (2, 64, 2, 16), (64, 64)),
}
CONFIGS = {"tiny": TINY, "gqa": GQA}


def assert_shards(model, mesh, expected):
    head = model.embed_tokens.embedding if model.config.tie_word_embeddings else model.lm_head.kernel
    attn = model.layers.self_attn
    for var, shape in zip((model.layers.mlp.gate_proj.kernel, attn.q_proj.kernel, attn.k_proj.kernel, head), expected):
        arr = var.get_value()
        assert arr.sharding.mesh.devices.size == mesh.devices.size
        assert {s.data.shape for s in arr.addressable_shards} == {shape}, var


@pytest.fixture(scope="module")
def one_device_logits(tokens):
    mesh = nnxscale.make_mesh("data=1", devices=jax.devices()[:1])
    out = {}
    for name, cfg in CONFIGS.items():
        model = nnxscale.sharded_init(lambda: Llama(cfg, rngs=nnx.Rngs(0)), mesh, rules=rules_for(mesh))
        out[name] = sharded_logits(model, mesh, tokens)
    return out


@pytest.mark.parametrize("name, spec", MESHES)
def test_same_logits_on_every_mesh(name, spec, tokens, one_device_logits):
    mesh = nnxscale.make_mesh(spec)
    model = nnxscale.sharded_init(lambda: Llama(CONFIGS[name], rngs=nnx.Rngs(0)), mesh, rules=rules_for(mesh))
    assert_shards(model, mesh, MESHES[name, spec])
    with record_activations() as records:
        logits = sharded_logits(model, mesh, tokens)
    np.testing.assert_allclose(logits, one_device_logits[name], rtol=1e-5, atol=1e-5)
    # K/V activations follow their heads: split over model when it divides them, else whole
    kv = {r.layout.spec for r in records if r.names == ("batch", "length", "kv_heads", "kv")}
    batch = "data" if "data" in spec else "fsdp" if "fsdp" in spec else None
    split = "model" if "model" in spec and CONFIGS[name].num_key_value_heads % mesh.shape["model"] == 0 else None
    assert kv == {P(batch, None, split, None)}, kv


def test_lint_says_when_the_model_axis_does_not_divide_the_kv_heads():
    mesh = nnxscale.make_mesh("model=8")
    for cfg, indivisible in ((TINY, set()), (GQA, {"layers.self_attn.k_proj.kernel", "layers.self_attn.v_proj.kernel"})):
        abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
        findings = nnxscale.lint(abstract, mesh, rules_for(mesh))
        assert {f.path for f in findings if f.kind == "indivisible"} == indivisible, findings
        assert not [f for f in findings if f.kind == "unused-rule"]
    notes = [f.message for f in findings if f.kind == "indivisible"]
    assert all("kv_heads=2" in m and "not divisible by 8" in m and "'model'" in m for m in notes), notes


@pytest.mark.parametrize("spec", ["fsdp=8", "data=2,model=4"])
def test_from_pretrained_onto_a_mesh(spec, checkpoint, sharded_checkpoint, tokens):
    path, model, logits = checkpoint
    mesh = nnxscale.make_mesh(spec)
    expected = params_by_path(model)
    for where in (path, sharded_checkpoint):
        loaded = from_pretrained(where, mesh=mesh, rules=rules_for(mesh))
        if ("gqa", spec) in MESHES:
            assert_shards(loaded, mesh, MESHES["gqa", spec])
        else:  # fsdp=8: every parameter split along embed (64 / 8), the stacked axis whole
            assert {s.data.shape for s in loaded.layers.self_attn.q_proj.kernel.get_value().addressable_shards} == {(2, 8, 8, 16)}
            assert {s.data.shape for s in loaded.layers.self_attn.o_proj.kernel.get_value().addressable_shards} == {(2, 8, 16, 8)}
            assert {s.data.shape for s in loaded.lm_head.kernel.get_value().addressable_shards} == {(8, 256)}
        for k, v in params_by_path(loaded).items():
            assert np.array_equal(v, expected[k]), k
        np.testing.assert_allclose(sharded_logits(loaded, mesh, tokens), logits, rtol=1e-5, atol=1e-5)


# ------------------------------------------------- 5. dtype, remat, dropout, errors


def test_bfloat16_compute_is_close_to_float32(checkpoint, tokens):
    path, _, logits = checkpoint
    model = from_pretrained(path, dtype="bfloat16")
    assert model.config.dtype == "bfloat16"
    assert model.embed_tokens.embedding.get_value().dtype == jnp.float32  # params stay float32
    out = jit_logits(model, tokens)
    assert out.dtype == np.float32
    err = np.abs(out - logits).max()
    assert 0 < err < 0.03 * np.abs(logits).max(), err  # differs (bf16 really used), but only a little


def _loss_and_grads(cfg, tokens, mesh=None):
    graphdef, state = nnx.split(randomize(Llama(cfg, rngs=nnx.Rngs(0))))

    def loss_fn(state):
        logits = nnx.merge(graphdef, state)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    if mesh is None:
        return jax.jit(jax.value_and_grad(loss_fn))(state)
    state = jax.device_put(state, nnxscale.state_shardings(state, mesh, rules_for(mesh)))
    tokens = jax.device_put(tokens, NamedSharding(mesh, batch_spec(None, mesh)))

    @jax.jit
    def step(state):
        with nnxscale.use_rules(rules_for(mesh)):
            return jax.value_and_grad(loss_fn)(state)

    return step(state)


@pytest.fixture(scope="module")
def reference_grads(tokens):
    return _loss_and_grads(GQA, tokens)


def _assert_same(a, b):
    (loss, grads), (loss_b, grads_b) = a, b
    np.testing.assert_allclose(loss_b, loss, rtol=1e-6)
    for g, g_b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(g_b, g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", ["full", "dots", "dots-except-mlp-in"])
def test_remat_same_loss_and_gradients(policy, tokens, reference_grads):
    _assert_same(reference_grads, _loss_and_grads(dataclasses.replace(GQA, remat=policy), tokens))


def test_same_loss_and_gradients_with_tensor_parallel_kv_heads(tokens, reference_grads):
    _assert_same(reference_grads, _loss_and_grads(GQA, tokens, nnxscale.make_mesh("data=2,model=4")))


def test_dropout_only_with_rngs(tokens):
    model = Llama(preset("llama-tiny", dropout=0.1), rngs=nnx.Rngs(0))
    plain = jit_logits(Llama(TINY, rngs=nnx.Rngs(0)), tokens)  # same parameters, no dropout
    np.testing.assert_array_equal(jit_logits(model, tokens), plain)
    a, b, c = (jit_logits(model, tokens, jax.random.key(seed)) for seed in (1, 1, 2))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, plain, atol=1e-3)
    assert not np.allclose(a, c, atol=1e-3)


def test_errors():
    model = Llama(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sequence length 129 exceeds.*max_position_embeddings=128"):
        model(jnp.zeros((1, 129), jnp.int32))
    with pytest.raises(ValueError, match="unknown Llama preset 'llama-7b'.*llama-3.2-1b.*llama-tiny"):
        preset("llama-7b")
    with pytest.raises(ValueError, match="num_attention_heads=16 is not a multiple of num_key_value_heads=6"):
        preset("llama-tiny", num_key_value_heads=6)
    with pytest.raises(ValueError, match="hidden_size=100 is not divisible by num_attention_heads=16: set head_dim"):
        preset("llama-tiny", hidden_size=100)
    with pytest.raises(ValueError, match="head width 7 is odd"):
        preset("llama-tiny", head_dim=7)
    with pytest.raises(ValueError, match="num_hidden_layers must be a positive integer"):
        preset("llama-tiny", num_hidden_layers=0)
    with pytest.raises(ValueError, match="unknown LlamaConfig fields"):
        preset("llama-tiny", n_layer=2)
    with pytest.raises(ValueError, match="remat must be one of none, full, dots, dots-except-mlp-in"):
        preset("llama-tiny", remat="some")
    with pytest.raises(ValueError, match="low_freq_factor=4.0 must be below high_freq_factor=1.0"):
        RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0, original_max_position_embeddings=8192)
    with pytest.raises(ValueError, match="rope_scaling needs exactly the fields.*unknown \\['beta'\\]"):
        preset("llama-tiny", rope_scaling={**dataclasses.asdict(GQA.rope_scaling), "beta": 1})


def test_config_dict_round_trip():
    cfg = preset("llama-3.1-8b", dropout=0.1, dtype="bfloat16", remat=True, head_dim=128)
    assert isinstance(cfg.rope_scaling, RopeScaling) and cfg.remat == "full"
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert hash(cfg) == hash(LlamaConfig.from_dict(cfg.to_dict()))  # hashable: the config is static in a graphdef
    with pytest.raises(ValueError, match="unknown LlamaConfig fields"):
        LlamaConfig.from_dict({**cfg.to_dict(), "rope_type": "llama3"})


# ------------------------------------------- 6. against Hugging Face's own implementation


HF_FIXTURE = Path(__file__).parent / "data" / "hf_llama"


@pytest.mark.parametrize("spec", [None, "data=2,model=4", "fsdp=8"])
def test_logits_match_a_checkpoint_written_by_hugging_face(spec, tmp_path):
    """tests/data/hf_llama: a random LlamaForCausalLM written by transformers' own
    save_pretrained (config.json in its format, Llama 3 rope scaling, 4 query heads on 2
    K/V heads) and its logits from transformers (tools/make_llama_fixture.py)."""
    tokens = np.load(HF_FIXTURE / "tokens.npy")
    want = np.load(HF_FIXTURE / "model" / "hf_logits.npy")
    if spec is None:
        model = from_pretrained(HF_FIXTURE / "model")
        got = np.asarray(model(jnp.asarray(tokens)))
    else:
        mesh = nnxscale.make_mesh(spec)
        model = from_pretrained(HF_FIXTURE / "model", mesh=mesh, rules=rules_for(mesh))
        got = sharded_logits(model, mesh, np.repeat(tokens, 4, axis=0))[::4]  # 8 rows: a batch fsdp=8 splits
    assert got.shape == want.shape == (2, 24, 96)
    assert np.abs(want).max() > 0.1  # logits of a random model, not zeros
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    # Written back in Hugging Face's layout: every tensor the same, by name, shape and value.
    save_pretrained(from_pretrained(HF_FIXTURE / "model"), tmp_path / "out")
    theirs, ours = load_file(HF_FIXTURE / "model" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert theirs.keys() == ours.keys()
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
