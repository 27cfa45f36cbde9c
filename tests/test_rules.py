"""Logical axis rules: presets, first match wins, axes a mesh lacks drop out, every preset on every mesh."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import nnxscale
from nnxscale.sharding.rules import INDIVISIBLE, LOGICAL_KEY, NOT_SPLIT, REUSED, RulesError, batch_shard_count, batch_spec

L = nnxscale.logical
_init = nnx.initializers.lecun_normal()
_zeros = nnx.initializers.zeros_init()


class Tiny(nnx.Module):
    """Embedding, attention projection, MLP: every logical name nnxscale's models use."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 32, embedding_init=L(nnx.initializers.normal(1.0), "vocab", "embed"), rngs=rngs)
        self.attn = nnx.LinearGeneral(
            32, (8, 4), kernel_init=L(_init, "embed", "heads", "kv"), bias_init=L(_zeros, "heads", "kv"), rngs=rngs
        )
        self.up = nnx.Linear(32, 64, kernel_init=L(_init, "embed", "mlp"), bias_init=L(_zeros, "mlp"), rngs=rngs)
        self.down = nnx.Linear(64, 32, kernel_init=L(_init, "mlp", "embed"), bias_init=L(_zeros, "embed"), rngs=rngs)


@pytest.fixture(scope="module")
def tiny():
    return Tiny(nnx.Rngs(0))


def _norm(spec):
    """P(None) and P() mean the same: compare specs without trailing Nones."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def spec(names, rules, mesh):
    return _norm(nnxscale.logical_to_spec(names, rules, mesh))


def test_logical_is_metadata_only(tiny):
    # created outside any mesh without error, on one device, carrying the names
    assert tiny.up.kernel.get_metadata()[LOGICAL_KEY] == ("embed", "mlp")
    assert tiny.attn.kernel.get_metadata()[LOGICAL_KEY] == ("embed", "heads", "kv")
    assert len(tiny.up.kernel[...].sharding.device_set) == 1


# -------------------------------------------------------------------------------------
# presets resolve as documented
# -------------------------------------------------------------------------------------


@pytest.mark.parametrize("as_dict", [False, True], ids=["Mesh", "dict"])
def test_auto_on_data_parallel_mesh(as_dict):
    mesh = nnxscale.make_mesh("data=8")
    m = dict(mesh.shape) if as_dict else mesh
    assert spec(("batch", None), "auto", m) == ("data",)
    for names in [("embed", "mlp"), ("mlp", "embed"), ("vocab", "embed"), ("embed", "heads", "kv")]:
        assert spec(names, "auto", m) == (), names
    assert spec(("embed", "mlp"), None, m) == ()  # None is auto


def test_auto_and_fsdp_on_fsdp_mesh():
    mesh = nnxscale.make_mesh("fsdp=8")
    for rules in ("auto", "fsdp", "fsdp_tp"):
        assert spec(("embed", "mlp"), rules, mesh) == ("fsdp",)
        assert spec(("mlp", "embed"), rules, mesh) == (None, "fsdp")
        assert spec(("vocab", "embed"), rules, mesh) == (None, "fsdp")
        assert spec(("batch", None), rules, mesh) == ("fsdp",)
    # data parallel and tensor parallel leave parameters whole on an fsdp mesh
    assert spec(("embed", "mlp"), "dp", mesh) == ()
    assert spec(("embed", "mlp"), "tp", mesh) == ()


def test_tensor_parallel_on_2x4():
    mesh = nnxscale.make_mesh("data=2,model=4")
    for rules in ("auto", "tp", "fsdp_tp"):
        assert spec(("embed", "mlp"), rules, mesh) == (None, "model")
        assert spec(("mlp", "embed"), rules, mesh) == ("model",)
        assert spec(("embed", "heads", "kv"), rules, mesh) == (None, "model")
        assert spec(("vocab", "embed"), rules, mesh) == ("model",)
        assert spec(("batch", "length"), rules, mesh) == ("data",)
    for rules in ("dp", "fsdp"):
        assert spec(("embed", "mlp"), rules, mesh) == ()
        assert spec(("vocab", "embed"), rules, mesh) == ()


def test_auto_on_3d_mesh():
    mesh = nnxscale.make_mesh("data=2,fsdp=2,tensor=2")
    assert spec(("embed", "mlp"), "auto", mesh) == ("fsdp", "tensor")
    assert spec(("mlp", "embed"), "auto", mesh) == ("tensor", "fsdp")
    assert spec(("batch", None), "auto", mesh) == (("data", "fsdp"),)


def test_multi_axis_entries_are_tuples_single_are_strings():
    mesh = {"data": 2, "fsdp": 4}
    got = nnxscale.logical_to_spec(("batch", None), "dp", mesh)
    assert got[0] == ("data", "fsdp")
    assert nnxscale.logical_to_spec(("batch",), "dp", {"data": 8})[0] == "data"


# -------------------------------------------------------------------------------------
# resolution semantics
# -------------------------------------------------------------------------------------


def test_first_match_wins():
    rules = [("mlp", "tensor"), ("mlp", "model")]
    # the first rule's axis is absent: it drops out and the second decides
    assert spec(("mlp",), rules, {"data": 2, "model": 4}) == ("model",)
    assert spec(("mlp",), rules, {"tensor": 8}) == ("tensor",)
    # both present: the first wins, the second adds nothing
    assert spec(("mlp",), rules, {"tensor": 2, "model": 4}) == ("tensor",)
    assert spec(("mlp",), list(reversed(rules)), {"tensor": 2, "model": 4}) == ("model",)


def test_explicit_none_wins():
    mesh = {"data": 2, "model": 4}
    assert spec(("mlp",), [("mlp", None), ("mlp", "model")], mesh) == ()
    assert spec(("mlp",), [("mlp", "model"), ("mlp", None)], mesh) == ("model",)
    # an explicit None even beats a logical name that is a mesh axis
    assert spec(("model",), [("model", None)], mesh) == ()
    # a rule whose axes are all absent does not count as None
    assert spec(("mlp",), [("mlp", "tensor"), ("mlp", "model")], mesh) == ("model",)


def test_absent_axes_drop_out():
    rules = [("batch", ("data", "fsdp")), ("mlp", ("fsdp", "model"))]
    assert spec(("batch",), rules, {"data": 8}) == ("data",)
    assert spec(("batch",), rules, {"fsdp": 8}) == ("fsdp",)
    assert spec(("batch",), rules, {"data": 2, "fsdp": 4}) == (("data", "fsdp"),)
    assert spec(("mlp",), rules, {"data": 2, "model": 4}) == ("model",)
    assert spec(("mlp",), rules, {"fsdp": 2, "model": 4}) == (("fsdp", "model"),)
    assert spec(("mlp",), rules, {"data": 8}) == ()


def test_logical_name_equal_to_mesh_axis_maps_to_it():
    mesh = {"data": 2, "model": 4}
    assert spec((None, "model"), "dp", mesh) == (None, "model")
    assert spec(("data", None), "tp", mesh) == ("data",)
    assert spec(("model",), "dp", {"data": 8}) == ()  # not an axis of this mesh: replicated
    # a matching rule decides before the identity fallback
    assert spec(("model",), [("model", "data")], mesh) == ("data",)
    assert spec(("unknown_name", "mlp"), "auto", mesh) == (None, "model")


# -------------------------------------------------------------------------------------
# rule tables from strings, mappings, sequences
# -------------------------------------------------------------------------------------


def test_custom_rule_string_parses():
    rules = nnxscale.get_rules("batch=data+fsdp,mlp=model,embed=")
    table = (("batch", ("data", "fsdp")), ("mlp", ("model",)), ("embed", None))
    assert rules.params == table and rules.activations == table  # a bare rule applies to both
    assert nnxscale.get_rules(" batch = data + fsdp , mlp = model , embed = ") == rules
    mesh = {"data": 2, "fsdp": 2, "model": 2}
    assert spec(("batch", None), table, mesh) == (("data", "fsdp"),)
    assert spec(("embed", "mlp"), table, mesh) == (None, "model")
    # the string is accepted wherever rules are
    assert spec(("embed", "mlp"), "batch=data+fsdp,mlp=model,embed=", mesh) == (None, "model")
    # an empty value replicates explicitly, and wins over a later rule
    assert spec(("embed",), "embed=,embed=fsdp", {"fsdp": 8}) == ()


def test_rules_from_mapping_sequence_and_presets():
    assert nnxscale.get_rules(None) == nnxscale.PRESETS["auto"]
    for name, rules in nnxscale.PRESETS.items():
        assert nnxscale.get_rules(name) == rules
    got = nnxscale.get_rules({"mlp": ["model", "tensor"], "embed": None})
    assert got.params == got.activations == (("mlp", ("model", "tensor")), ("embed", None))
    got = nnxscale.get_rules([("mlp", "model"), ("heads", ("model",))])
    assert got.params == (("mlp", "model"), ("heads", ("model",)))


def test_rule_strings_address_one_table_and_include_presets():
    rules = nnxscale.get_rules("batch=data,mlp=model,param.embed=fsdp,act.length=model")
    assert rules.params == (("batch", ("data",)), ("mlp", ("model",)), ("embed", ("fsdp",)))
    assert rules.activations == (("batch", ("data",)), ("mlp", ("model",)), ("length", ("model",)))
    # a preset named in a string comes after the written rules, which therefore win
    rules = nnxscale.get_rules("layers=stage,fsdp")
    fsdp = nnxscale.PRESETS["fsdp"]
    assert rules.params == (("layers", ("stage",)),) + fsdp.params
    assert rules.activations == (("layers", ("stage",)),) + fsdp.activations
    assert spec(("layers", "embed"), rules, {"stage": 2, "fsdp": 4}) == ("stage", "fsdp")
    assert spec(("layers", "embed"), "fsdp", {"stage": 2, "fsdp": 4}) == ("stage", "fsdp")  # presets split layers too
    assert spec(("layers", "embed"), "layers=,fsdp", {"stage": 2, "fsdp": 4}) == (None, "fsdp")  # unless overridden
    # and the string form prints back to something that parses to the same rules
    assert nnxscale.get_rules(str(nnxscale.get_rules("batch=data,mlp=model"))) == nnxscale.get_rules("batch=data,mlp=model")


def test_unknown_preset_lists_presets():
    with pytest.raises(RulesError) as info:
        nnxscale.get_rules("megatron")
    msg = str(info.value)
    assert "'megatron'" in msg
    for name in nnxscale.PRESETS:
        assert name in msg
    assert issubclass(RulesError, ValueError)
    with pytest.raises(RulesError):
        nnxscale.logical_to_spec(("mlp",), "megatron", {"model": 8})


@pytest.mark.parametrize("bad", ["mlp=model,", "=model", "mlp=model=tensor"])
def test_malformed_rule_strings(bad):
    with pytest.raises(RulesError):
        nnxscale.get_rules(bad)


# -------------------------------------------------------------------------------------
# batch layout
# -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh_spec, rules, expected",
    [
        ("data=8", "auto", ("data",)),
        ("fsdp=8", "auto", ("fsdp",)),
        ("fsdp=8", "tp", ("fsdp",)),
        ("data=2,model=4", "dp", ("data",)),
        ("data=2,fsdp=2,tensor=2", "auto", (("data", "fsdp"),)),
        ("model=8", "auto", ()),
    ],
)
def test_batch_spec_and_shard_count(mesh_spec, rules, expected):
    mesh = nnxscale.make_mesh(mesh_spec)
    for ndim in (1, 2, 3):
        s = batch_spec(rules, mesh, ndim=ndim)
        assert len(s) == ndim and all(e is None for e in list(s)[1:])
        assert _norm(s) == expected
    count = batch_shard_count(rules, mesh)
    assert batch_shard_count(rules, dict(mesh.shape)) == count
    # what the count promises: a global batch of 3*count rows puts 3 rows on each device
    batch = jax.device_put(np.zeros((3 * count, 5), np.float32), NamedSharding(mesh, batch_spec(rules, mesh)))
    assert {s.data.shape for s in batch.addressable_shards} == {(3, 5)}


# -------------------------------------------------------------------------------------
# every preset on every mesh of the "switching among parallelisms on 8 devices" slide
# -------------------------------------------------------------------------------------

SLIDE_MESHES = ["data=4,model=2", "data=2,model=4", "data=1,model=8", "data=8,model=1", "fsdp=8"]


@pytest.mark.parametrize("mesh_spec", SLIDE_MESHES)
@pytest.mark.parametrize("preset", sorted(nnxscale.PRESETS))
def test_every_preset_gives_valid_layouts(tiny, preset, mesh_spec):
    mesh = nnxscale.make_mesh(mesh_spec)
    rules = nnxscale.resolve(preset, mesh, min_shard_bytes=0)  # the tiny model's tensors are all small
    specs = nnxscale.state_specs(tiny, mesh, rules)
    placed = nnx.state(nnxscale.place(tiny, mesh, rules))
    flat_specs = dict(jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0])
    flat_placed = dict(jax.tree_util.tree_flatten_with_path(placed)[0])
    assert len(flat_specs) == 7
    for path, s in flat_specs.items():
        arr = next(v for k, v in flat_placed.items() if k[: len(path)] == path)
        used = [a for e in s if e is not None for a in ((e,) if isinstance(e, str) else e)]
        assert len(used) == len(set(used)) and set(used) <= set(mesh.axis_names), (path, s)
        assert _norm(arr.sharding.spec) == _norm(s)
        expected_shard = nnxscale.shard_shape(arr.shape, s, mesh)
        assert {sh.data.shape for sh in arr.addressable_shards} == {expected_shard}
        assert len(arr.addressable_shards) == 8
    # the rules, not the mesh alone, decide: tensor-parallel presets shard the MLP on any model axis > 1
    up = flat_specs[next(p for p in flat_specs if "up" in str(p) and "kernel" in str(p))]
    model_size = dict(mesh.shape).get("model", 1)
    if preset in ("auto", "tp", "fsdp_tp") and model_size > 1:
        assert _norm(up) == (None, "model")
    if preset == "dp":
        assert _norm(up) == ()
    if mesh_spec == "fsdp=8" and preset in ("auto", "fsdp", "fsdp_tp"):
        assert _norm(up) == ("fsdp",)


# -------------------------------------------------------------------------------------
# parameters and activations: two tables
# -------------------------------------------------------------------------------------


def aspec(names, rules, mesh, shape=None):
    return _norm(nnxscale.logical_to_spec(names, rules, mesh, shape=shape, kind="activations"))


@pytest.mark.parametrize("preset", sorted(nnxscale.PRESETS))
def test_every_preset_defines_both_tables_for_every_logical_name(preset):
    from nnxscale.sharding.rules import LOGICAL_NAMES

    rules = nnxscale.PRESETS[preset]
    for table in (rules.params, rules.activations):
        assert set(LOGICAL_NAMES) <= {name for name, _ in table}


def test_fsdp_splits_parameters_along_embed_and_activations_along_the_batch():
    mesh = {"fsdp": 8}
    for preset in ("auto", "fsdp", "fsdp_tp"):
        assert spec(("vocab", "embed"), preset, mesh) == (None, "fsdp")  # parameters: ZeRO-3
        assert aspec(("batch", "length", "embed"), preset, mesh) == ("fsdp",)  # activations: the rows
        assert aspec(("batch", "length", "mlp"), preset, mesh) == ("fsdp",)
    # tensor parallel splits heads and the MLP hidden in both tables
    mesh = {"data": 2, "model": 4}
    for preset in ("auto", "tp", "fsdp_tp"):
        assert spec(("embed", "mlp"), preset, mesh) == (None, "model")
        assert aspec(("batch", "length", "mlp"), preset, mesh) == ("data", None, "model")
        assert aspec(("batch", "length", "heads", "kv"), preset, mesh) == ("data", None, "model")
        assert aspec(("batch", "length", "embed"), preset, mesh) == ("data",)
    assert aspec(("batch", "length", "mlp"), "dp", mesh) == ("data",)


def test_the_issue_example_is_a_valid_spec():
    # batch and embed both ask for fsdp: the first dimension keeps it, the second loses it
    for kind in ("params", "activations"):
        got = nnxscale.logical_to_spec(("batch", "length", "embed"), "auto", {"fsdp": 8}, kind=kind)
        assert got == P("fsdp", None, None)
    lay = nnxscale.resolve("auto", {"fsdp": 8}).param_layout(("batch", "length", "embed"), (8, 16, 4096))
    assert lay.spec == P("fsdp", None, None)
    assert any("dim 2 (embed)" in note and "already shards" in note for note in lay.dropped), lay.dropped
    # The reason is a field, not text to search: lint and the planner read it.
    (dropped,) = lay.dropped
    assert (dropped.dim, dropped.name, dropped.axis, dropped.reason) == (2, "embed", "fsdp", REUSED)
    lay = nnxscale.resolve("auto", {"data": 2, "model": 4}).param_layout(("embed", "mlp"), (64, 6))
    assert [(d.dim, d.axis, d.reason) for d in lay.dropped] == [(1, "model", INDIVISIBLE)]
    small = nnxscale.resolve("fsdp", {"fsdp": 8}, min_shard_bytes=1 << 20).param_layout(("embed", "mlp"), (8, 16))
    assert small.spec == P(None, None) and {d.reason for d in small.dropped} == {NOT_SPLIT}


NAMES = ["batch", "length", "layers", "embed", "mlp", "heads", "kv", "vocab", None]
MESHES = [{"fsdp": 8}, {"data": 2, "model": 4}, {"data": 2, "fsdp": 2, "tensor": 2}, {"stage": 2, "fsdp": 2, "model": 2}]


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_no_lookup_ever_produces_an_invalid_spec(mesh):
    import itertools

    custom = ["batch=data+fsdp,embed=fsdp+model,mlp=model+fsdp,heads=model,layers=stage", "layers=stage,fsdp_tp"]
    rng = np.random.default_rng(0)
    for rules in list(nnxscale.PRESETS) + custom:
        resolved = nnxscale.resolve(rules, mesh, min_shard_bytes=0)
        for names in itertools.product(NAMES, repeat=3):
            shape = tuple(int(rng.choice([8, 12, 16, 50257, 768, 1])) for _ in names)
            for layout in (resolved.param_layout(names, shape), resolved.activation_layout(names, shape)):
                axes = [a for e in layout.spec for a in ((e,) if isinstance(e, str) else e or ())]
                assert len(axes) == len(set(axes)), (rules, names, layout.spec)
                assert set(axes) <= set(mesh), (rules, names, layout.spec)
                assert nnxscale.shard_shape(shape, layout.spec, mesh)  # divides: raises otherwise


def test_small_parameters_are_not_split_over_fsdp_axes():
    from nnxscale.sharding.rules import MIN_SHARD_BYTES

    assert MIN_SHARD_BYTES == 1 << 20
    r = nnxscale.resolve("auto", {"fsdp": 8})
    assert r.param_spec(("embed",), (768,)) == P(None)  # a LayerNorm scale: 3 KiB, kept whole
    assert r.param_spec(("embed", "mlp"), (768, 3072)) == P("fsdp", None)  # 9 MiB: split
    assert r.param_spec(("embed", "mlp"), (256, 1024), "float32") == P("fsdp", None)  # exactly 1 MiB: split
    assert r.param_spec(("embed", "mlp"), (256, 1024), "bfloat16") == P(None, None)  # 512 KiB: whole
    # the threshold is the FSDP (batch-splitting) axes' only: tensor parallelism still splits small ones
    r = nnxscale.resolve("auto", {"data": 2, "model": 4})
    assert r.param_spec(("mlp",), (3072,)) == P("model")
    # and it can be turned off
    assert nnxscale.resolve("auto", {"fsdp": 8}, min_shard_bytes=0).param_spec(("embed",), (768,)) == P("fsdp")


def test_unannotated_parameters_obey_the_preset():
    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(512, 1024, rngs=rngs)  # no logical names

    model = nnx.eval_shape(lambda: Plain(nnx.Rngs(0)))
    cases = {
        ("dp", "data=4,model=2"): (P(None, None), P(None)),
        ("auto", "data=4,model=2"): (P(None, "model"), P("model")),
        ("tp", "data=4,model=2"): (P(None, "model"), P("model")),
        ("auto", "fsdp=8"): (P("fsdp", None), P(None)),  # the 4 KiB bias is below the FSDP minimum
        ("dp", "fsdp=8"): (P(None, None), P(None)),
    }
    for (rules, mesh), (kernel, bias) in cases.items():
        specs = nnxscale.state_specs(model, nnxscale.parse_mesh_spec(mesh), rules)
        assert specs["lin"]["kernel"] == kernel, (rules, mesh)
        assert specs["lin"]["bias"] == bias, (rules, mesh)


def test_a_run_says_which_tensors_its_mesh_cannot_split():
    """gpt2's 12 heads on model=8 stay whole: the run's start lines say so (as `plan`'s lint
    does), once per tensor whatever the depth; on model=4 the heads split and only the
    50,257-word embedding stays whole."""
    from nnxscale.training.config import TrainConfig, with_overrides
    from nnxscale.training.loop import layout_findings
    from nnxscale.training.state import setup

    cfg = with_overrides(TrainConfig(), {"model.name": "gpt2", "parallel.mesh": "data=1,model=8", "data.batch_size": 8})
    lines = layout_findings(setup(cfg))
    assert "[indivisible] h.attn.c_attn.kernel: dim 3 (heads=12) is not divisible by 8 (mesh axes ('model',)): " \
           "not sharded over 'model'" in lines, lines  # fmt: skip
    assert len(lines) == len(set(lines)) == 4, lines  # c_attn kernel and bias, c_proj, the 50,257-word embedding
    four = layout_findings(setup(with_overrides(cfg, {"parallel.mesh": "data=2,model=4"})))  # 12 heads split 4 ways
    assert [line.split(":")[0] for line in four] == ["[indivisible] wte.embedding"], four
