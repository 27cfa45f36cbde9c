"""The decoder's architectures (Qwen2/3, Qwen3-MoE, Mistral, Gemma 2/3, DeepSeek-V3, with
Llama and Mixtral): logits equal to transformers' on small random checkpoints written by
transformers itself (tools/make_decoder_fixtures.py: every switch set so that it changes the
logits), the same tensors written back, the published parameter counts, the layer stacks a
pattern makes, and clear errors."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import nnxscale
from model_testing import jit_logits, rules_for, sharded_logits
from nnxscale.errors import ModelError
from nnxscale.models import FAMILIES, find_preset, pretrained_family
from nnxscale.models.decoder import LayerKind, layer_segments

DATA = Path(__file__).parent / "data"
FIXTURES = ["hf_qwen2", "hf_qwen3", "hf_qwen3_moe", "hf_qwen3_moe_norm", "hf_mistral", "hf_gemma2", "hf_gemma3_text",
            "hf_gemma3", "hf_deepseek_v3", "hf_deepseek_v2_lite_style", "hf_deepseek_v2"]  # fmt: skip
PUBLISHED = {k: v for k, v in json.loads((Path(__file__).parent.parent / "tools" / "published_counts.json").read_text()).items()
             if not k.startswith("_")}  # fmt: skip


def _load(name, **kw):
    path = DATA / name / "model"
    return pretrained_family(path).from_pretrained(path, **kw)


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_equal_transformers(name):
    tokens = np.load(DATA / name / "tokens.npy")
    want = np.load(DATA / name / "model" / "hf_logits.npy")
    got = jit_logits(_load(name), jnp.asarray(tokens))
    assert got.shape == want.shape and np.abs(want).max() > 1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name,spec", [("hf_gemma3_text", "data=2,model=2,fsdp=2"), ("hf_deepseek_v3", "data=2,expert=4"),
                                       ("hf_qwen3_moe", "expert=2,fsdp=2,model=2")])  # fmt: skip
def test_logits_equal_transformers_loaded_onto_a_mesh(name, spec):
    """Each device reads only its slice, straight into the layout; the logits are the same."""
    mesh = nnxscale.make_mesh(spec)
    model = _load(name, mesh=mesh, rules=rules_for(mesh))
    tokens = np.load(DATA / name / "tokens.npy")
    got = sharded_logits(model, mesh, np.repeat(tokens, 4, axis=0))[::4]
    np.testing.assert_allclose(got, np.load(DATA / name / "model" / "hf_logits.npy"), rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", FIXTURES)
def test_save_pretrained_writes_the_same_tensors_and_reads_them_back(name, tmp_path):
    model = _load(name)
    family = pretrained_family(DATA / name / "model")
    family.save_pretrained(model, tmp_path / "out")
    theirs = load_file(DATA / name / "model" / "model.safetensors")
    if name == "hf_gemma3":  # the text tower, saved as Gemma3ForCausalLM names it
        theirs = {"model." + k.removeprefix("language_model.model."): v for k, v in theirs.items()
                  if k.startswith("language_model.model.")}  # fmt: skip
    ours = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    again = pretrained_family(tmp_path / "out").from_pretrained(tmp_path / "out")
    assert again.config == model.config
    tokens = jnp.asarray(np.load(DATA / name / "tokens.npy"))
    np.testing.assert_array_equal(jit_logits(again, tokens), jit_logits(model, tokens))


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(preset):
    """Counted by transformers on the meta device (tools/count_published.py)."""
    published = PUBLISHED[preset]
    _, config = find_preset(preset)
    assert config.num_params() == published["total_params"]
    if published.get("active_params"):
        assert config.active_params() == published["active_params"]


def test_the_published_configs_translate_to_the_presets():
    """Each published config.json (as its checkpoint carries it) reads as the preset's network."""
    for preset, published in PUBLISHED.items():
        family, config = find_preset(preset)
        hf = published["config"]
        from_json = family.from_pretrained.__self__.config(hf, preset)
        differ = [f for f in ("num_hidden_layers", "hidden_size", "num_local_experts", "dense_layers", "layer_types",
                              "sliding_window", "head_size", "rope_scaling", "local_rope_theta", "q_lora_rank",
                              "router_scoring", "router_score_bias", "norm_topk_prob", "router_group_top")
                  if getattr(from_json, f) != getattr(config, f)]  # fmt: skip
        assert not differ, (preset, differ)


def test_a_repeating_pattern_is_scanned_as_groups():
    """Gemma 3's 5 sliding : 1 global over 7 layers: one group of 6 scanned, the 7th alone;
    DeepSeek's dense first layers a stack of their own; Llama one stack."""
    s, f, D, M = LayerKind(8, False), LayerKind(None, False), LayerKind(None, False), LayerKind(None, True)
    segs = layer_segments((s,) * 5 + (f, s))  # 3 bodies: 5 sliding stacked, then one group (global, sliding)
    assert [(g.name, g.start, g.groups, len(g.kinds)) for g in segs] == [("first_layers", 0, 5, 1), ("layers", 5, 1, 2)]
    segs = layer_segments((s,) * 5 + (f,) + (s,) * 5 + (f,) + (s,) * 2)  # gemma-3-1b's pattern, shorter
    kinds = [k for g in segs for _ in range(g.groups) for k in g.kinds]
    assert kinds == [s] * 5 + [f] + [s] * 5 + [f] + [s] * 2 and sum(len(g.kinds) for g in segs) <= 8
    segs = layer_segments((s, f) * 21)
    assert [(g.name, g.groups, len(g.kinds)) for g in segs] == [("layers", 21, 2)]
    segs = layer_segments((D,) * 3 + (M,) * 58)
    assert [(g.name, g.start, g.groups) for g in segs] == [("first_layers", 0, 3), ("layers", 3, 58)]
    _, gemma = find_preset("gemma-3-27b")  # 62 layers: 10 groups of 6 and 2 sliding layers, in some arrangement
    segs = gemma.segments()
    assert sum(g.layers for g in segs) == 62 and max(g.groups for g in segs) >= 10 and sum(len(g.kinds) for g in segs) <= 8
    model = _load("hf_gemma3_text")  # 7 layers: 5 sliding stacked, then (global, sliding) as one group
    assert model.first_layers.self_attn.q_proj.kernel[...].shape == (5, 32, 4, 16)
    assert model.first_layers.self_attn.window == 8 and model.layers.layer_1.self_attn.window == 8
    assert model.layers.layer_0.self_attn.window is None and model.layers.layer_0.self_attn.q_proj.kernel[...].shape == (1, 32, 4, 16)


def _copy(name, tmp_path, config=None, tensors=None):
    out = tmp_path / name
    shutil.copytree(DATA / name / "model", out)
    if config is not None:
        c = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(config(c)))
    if tensors is not None:
        t = load_file(out / "model.safetensors")
        tensors(t)
        save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_bad_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(ModelError, match="model_type 'qwen9'.*known types.*'qwen3'.*'gemma3_text'.*'deepseek_v3'"):
        pretrained_family(_copy("hf_qwen3", tmp_path / "a", config=lambda c: c | {"model_type": "qwen9"}))
    path = _copy("hf_qwen3", tmp_path / "b", config=lambda c: c | {"hidden_act": "relu"})
    with pytest.raises(ModelError, match="hidden_act='relu' is not supported"):
        FAMILIES["qwen"].from_pretrained(path)
    path = _copy("hf_gemma2", tmp_path / "c", config=lambda c: c | {"hidden_activation": "gelu"})
    with pytest.raises(ModelError, match="hidden_activation='gelu' is not supported"):
        FAMILIES["gemma"].from_pretrained(path)
    path = _copy("hf_qwen3", tmp_path / "d", config=lambda c: c | {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})
    with pytest.raises(ModelError, match="rope_type='longrope' is not supported"):
        FAMILIES["qwen"].from_pretrained(path)
    bad = np.zeros((7, 16), np.float32)
    path = _copy("hf_deepseek_v3", tmp_path / "e", tensors=lambda t: t.update({"model.layers.1.self_attn.kv_a_layernorm.weight": bad}))
    with pytest.raises(ModelError, match=r"'model\.layers\.1\.self_attn\.kv_a_layernorm\.weight' has shape \(7, 16\).*expects \(16,\)"):
        FAMILIES["deepseek"].from_pretrained(path)


def test_the_legacy_config_spelling_reads_the_same(tmp_path):
    """Published checkpoints carry rope_theta / rope_scaling / rope_local_base_freq, not
    transformers 5's rope_parameters: both read as the same network."""
    def legacy(c):
        params = c.pop("rope_parameters")
        full, local = params["full_attention"], params["sliding_attention"]
        return c | {"rope_theta": full.pop("rope_theta"), "rope_scaling": full, "rope_local_base_freq": local["rope_theta"]}

    new = FAMILIES["gemma"].pretrained_config(DATA / "hf_gemma3_text" / "model")
    old = FAMILIES["gemma"].pretrained_config(_copy("hf_gemma3_text", tmp_path, config=legacy))
    assert old == new and new.local_rope_theta == 10000.0 and new.rope_scaling.factor == 8.0


def test_one_entry_point_loads_and_saves_every_architecture(tmp_path):
    """nnxscale.models.from_pretrained dispatches on model_type; save_pretrained picks the
    family whose format holds the model."""
    from nnxscale import models

    for name, model_type in (("hf_deepseek_v3", "deepseek_v3"), ("hf_gemma2", "gemma2"), ("hf_qwen3_moe", "qwen3_moe"),
                             ("hf_mistral", "mistral"), ("hf_llama", "llama")):  # fmt: skip
        model = models.from_pretrained(DATA / name / "model")
        models.save_pretrained(model, tmp_path / name)
        assert json.loads((tmp_path / name / "config.json").read_text())["model_type"] == model_type
