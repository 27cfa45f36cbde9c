"""Model families: the registry, what the trainer reads from a family, the weight-decay mask
from Variable metadata, and --init-from a Hugging Face directory of the wrong architecture."""

import dataclasses
import json
import math

import jax
import pytest
from flax import nnx
from model_testing import counts_by_depth
from test_cli import assert_one_error_line, run_main, train_args

import nnxscale
from nnxscale.training.config import FLAT_NAMES, TrainConfig, with_overrides
from nnxscale.training import optimizer, state
from nnxscale.sharding.state import variable_logical_axes
from nnxscale.models import FAMILIES, ModelDims, find_preset, gpt2, pretrained_family
from nnxscale.errors import ModelError


def cfg_of(**fields):
    """A TrainConfig from flat or dotted names (``mesh=``, ``data.seq_len``)."""
    return with_overrides(TrainConfig(), {FLAT_NAMES.get(k, k): v for k, v in fields.items()})


def test_every_preset_of_every_family_builds_with_its_dimensions():
    names = [name for family in FAMILIES.values() for name in family.presets]
    assert len(names) == len(set(names)), "a preset name in two families"
    for family in FAMILIES.values():
        for name, config in family.presets.items():
            assert find_preset(name) == (family, config)
            depth = "n_layer" if hasattr(config, "n_layer") else "num_hidden_layers"
            if getattr(config, "layer_types", None) or getattr(config, "dense_layers", None):
                # layers of several kinds (Gemma's windows, DeepSeek's dense first layers): built whole,
                # abstractly; DeepSeek's correction bias is a buffer in the reference's count
                abstract = nnx.eval_shape(lambda: family.build(config, rngs=nnx.Rngs(0)))  # noqa: B023
                flat = jax.tree_util.tree_flatten_with_path(nnx.state(abstract, nnx.Param))[0]
                whole = sum(math.prod(x.shape) for p, x in flat if "router_bias" not in jax.tree_util.keystr(p))
            else:
                built, whole = counts_by_depth(lambda c: family.build(c, rngs=nnx.Rngs(0)), config, depth)  # noqa: B023
                assert built == [dataclasses.replace(config, **{depth: n}).num_params() for n in (1, 2)], name
            assert config.num_params() == whole, name
            dims = family.dims(config)
            assert isinstance(dims, ModelDims) and min(dataclasses.astuple(dims)) > 0, name
            assert dims.heads % dims.kv_heads == 0 and dims.width % dims.heads == 0, name
            active = config.active_params() if hasattr(config, "active_params") else config.num_params()  # a mixture: per token
            assert family.flops_per_token(config, dims.context) >= 4 * active, name
            assert set(family.run_options) <= {f.name for f in dataclasses.fields(config)}, name
        # Weight decay from the metadata: the matrices decay, vectors (norm scales, biases) do not.
        smallest = min(family.presets.values(), key=lambda c: c.num_params())
        state = nnx.state(nnx.eval_shape(lambda: family.build(smallest, rngs=nnx.Rngs(0))), nnx.Param)
        variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        decayed = [v for v in variables if optimizer.decays(v)]
        assert all(len([n for n in variable_logical_axes(v) or () if n != "layers"]) >= 2 for v in decayed), family.name
        size = lambda vs: sum(math.prod(v.get_value().shape) for v in vs)  # noqa: E731
        assert size(decayed) > 0.9 * size(variables), family.name  # embeddings and projections are most of a model


def test_an_unknown_preset_lists_every_family():
    with pytest.raises(ModelError) as info:
        find_preset("gpt3")
    message = str(info.value)
    assert "'gpt3'" in message
    for family in FAMILIES.values():
        assert f"{family.name}: " in message and all(name in message for name in family.presets)


def test_a_hugging_face_directory_is_recognized_by_its_model_type(tmp_path):
    model = gpt2.GPT2(gpt2.preset("gpt2-tiny"), rngs=nnx.Rngs(0))
    gpt2.save_pretrained(model, tmp_path / "hf")
    assert pretrained_family(tmp_path / "hf") is FAMILIES["gpt2"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(ModelError, match="model_type 'bert', which no model family loads: known types 'gpt2' \\(gpt2\\)"):
        pretrained_family(tmp_path / "hf")


def test_init_from_a_hugging_face_directory_of_another_architecture(tmp_path, text_data, capsys):
    gpt2.save_pretrained(gpt2.GPT2(gpt2.preset("gpt2-tiny"), rngs=nnx.Rngs(0)), tmp_path / "hf")
    code, _, err = run_main(capsys, train_args(tmp_path / "run", text_data, "--model", "gpt2-mini", "--init-from",
                                               str(tmp_path / "hf")))  # fmt: skip
    assert_one_error_line(code, err, "not the architecture of --model gpt2-mini", "n_embd: 64 vs 128", "n_layer: 2 vs 4")


# --------------------------------------------------------------------------------------
# weight decay: from Variable metadata, never from names
# --------------------------------------------------------------------------------------


def test_gpt2_decays_its_matrices_only():
    s = nnxscale.setup(cfg_of(model="gpt2-tiny", mesh="data=8"))
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(s.decay_mask)[0]}
    decayed = sorted(k for k, v in flat.items() if v)
    assert decayed == [
        "['h']['attn']['c_attn']['kernel']", "['h']['attn']['c_proj']['kernel']", "['h']['mlp']['c_fc']['kernel']",
        "['h']['mlp']['c_proj']['kernel']", "['wpe']['embedding']", "['wte']['embedding']",
    ]  # fmt: skip
    assert len(flat) == 16  # the biases (c_attn's is (layers, 3, heads, head_dim)) and the LayerNorms do not
    line = optimizer.describe_decay(s.decay_mask, s.abstract["params"], 0.1)
    assert line == "weight decay 0.1 on 6 of 16 parameter arrays, 480.0 KiB of 487.0 KiB (matrices; not norms or biases)"


def test_a_weight_decay_flag_and_unannotated_parameters():
    class Net(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.kept = nnx.Linear(4, 4, kernel_init=nnxscale.logical(init, "embed", "mlp", weight_decay=False), rngs=rngs)
            self.gate = nnx.Param(nnx.with_metadata(nnx.initializers.ones_init(), weight_decay=True)(rngs.params(), (4,)))
            self.plain = nnx.Linear(4, 4, rngs=rngs)  # no logical axes: its 2-D kernel decays, its bias not

        def __call__(self, x):
            return self.plain(self.kept(x)) * self.gate

    mask = optimizer.decay_mask(nnx.state(nnx.eval_shape(lambda: Net(nnx.Rngs(0)))))
    assert mask == {"kept": {"kernel": False, "bias": False}, "gate": True, "plain": {"kernel": True, "bias": False}}


def test_your_own_module_must_hold_parameters_only():
    class WithRngs(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(256, 8, rngs=rngs)
            self.dropout = nnx.Dropout(0.1, rngs=rngs)  # keeps an RNG stream: state the optimizer cannot update

        def __call__(self, tokens):
            return self.dropout(self.embed(tokens)) @ self.embed.embedding[...].T

    with pytest.raises(nnxscale.ConfigError, match="holds state that is not a parameter .*without rngs"):
        nnxscale.setup(cfg_of(model="mine", mesh="data=8"), model=lambda rngs: WithRngs(rngs))
    with pytest.raises(nnxscale.ConfigError, match="--dropout 0.1: these set a family preset's options"):
        nnxscale.setup(cfg_of(model="mine", mesh="data=8", dropout=0.1), model=lambda rngs: WithRngs(rngs))


def test_a_second_family_is_found_planned_and_checked_like_the_first(monkeypatch, tmp_path):
    """The trainer and the planner name no model: a family registered beside GPT-2 (here GPT-2's
    own module under another name, without dropout) is found, planned and checked as its own."""
    gpt2_family = FAMILIES["gpt2"]
    toy = dataclasses.replace(gpt2_family, name="toy", presets={"toy-tiny": gpt2.preset("gpt2-tiny")},
                              hf_model_types=("toy",), run_options=("dtype", "remat"))  # fmt: skip
    monkeypatch.setitem(FAMILIES, "toy", toy)
    assert find_preset("toy-tiny")[0] is toy

    cfg = cfg_of(model="toy-tiny", mesh="fsdp=8", min_shard_bytes=0, **{"data.seq_len": 64, "data.batch_size": 16})
    plan = nnxscale.plan(cfg, compile="never")
    assert plan.num_params == gpt2.preset("gpt2-tiny").num_params()
    assert any("fitted to gpt2's step" in note and "for a toy model" in note for note in plan.notes), plan.notes
    assert not any("fitted to" in note for note in nnxscale.plan(cfg_of(model="gpt2-tiny", mesh="fsdp=8", min_shard_bytes=0, **{"data.seq_len": 64, "data.batch_size": 16}), compile="never").notes)

    with pytest.raises(nnxscale.ConfigError, match="--dropout 0.1: toy-tiny \\(toy\\) has no such option; it takes dtype, remat"):
        nnxscale.setup(with_overrides(cfg, {"model.dropout": 0.1}))
    gpt2.save_pretrained(gpt2.GPT2(gpt2.preset("gpt2-tiny"), rngs=nnx.Rngs(0)), tmp_path / "hf")
    with pytest.raises(nnxscale.ConfigError, match="holds a gpt2 model, but --model toy-tiny is a toy preset"):
        state.load_init_params(nnxscale.setup(cfg), str(tmp_path / "hf"))
