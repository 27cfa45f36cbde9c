"""State sharding: specs from rules, sharded init on real devices, place/reshard, lint, the table."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import nnxscale

L = nnxscale.logical
_init = nnx.initializers.lecun_normal()
_bias = nnx.initializers.normal(1.0)  # non-zero, so bias values are compared too


class MLP(nnx.Module):
    """Annotated: up (embed, mlp), down (mlp, embed)."""

    def __init__(self, rngs: nnx.Rngs, d: int = 16, h: int = 64):
        self.up = nnx.Linear(d, h, kernel_init=L(_init, "embed", "mlp"), bias_init=L(_bias, "mlp"), rngs=rngs)
        self.down = nnx.Linear(h, d, kernel_init=L(_init, "mlp", "embed"), bias_init=L(_bias, "embed"), rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


class Net(nnx.Module):
    """An annotated MLP followed by an unannotated head (the fallback rank rule)."""

    def __init__(self, rngs: nnx.Rngs):
        self.mlp = MLP(rngs)
        self.head = nnx.Linear(16, 32, bias_init=_bias, rngs=rngs)

    def __call__(self, x):
        return self.head(self.mlp(x))


def make_net():
    return Net(nnx.Rngs(0))


@pytest.fixture(scope="module", autouse=True)
def no_fsdp_minimum():
    """The models here are kilobytes: switch the FSDP minimum size off so that their FSDP
    layouts show (the minimum itself is tested in test_rules.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nnxscale.sharding.rules, "MIN_SHARD_BYTES", 0)
        yield


def _is_var(x):
    return isinstance(x, nnx.Variable)


def _norm(spec):
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _flat(tree, is_leaf=None):
    """{"a.b": leaf} for a tree of Variables, specs or shardings."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        out[".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = leaf
    return out


def _values(model):
    return {k: np.asarray(v[...]) for k, v in _flat(nnx.state(model), _is_var).items()}


def _arrays(model):
    return {k: v[...] for k, v in _flat(nnx.state(model), _is_var).items()}


# expected specs under the default rules, from the rules' and the fallback's documentation
EXPECTED = {
    "data=8": {},
    "model=8": {
        "mlp.up.kernel": (None, "model"), "mlp.up.bias": ("model",), "mlp.down.kernel": ("model",),
        "head.kernel": (None, "model"), "head.bias": ("model",),
    },
    "data=2,model=4": {
        "mlp.up.kernel": (None, "model"), "mlp.up.bias": ("model",), "mlp.down.kernel": ("model",),
        "head.kernel": (None, "model"), "head.bias": ("model",),
    },
    "data=4,model=2": {
        "mlp.up.kernel": (None, "model"), "mlp.up.bias": ("model",), "mlp.down.kernel": ("model",),
        "head.kernel": (None, "model"), "head.bias": ("model",),
    },
    "fsdp=8": {
        "mlp.up.kernel": ("fsdp",), "mlp.down.kernel": (None, "fsdp"), "mlp.down.bias": ("fsdp",),
        "head.kernel": ("fsdp",),  # unannotated 2-D: taken as (embed, mlp)
    },
    "data=2,fsdp=2,tensor=2": {
        "mlp.up.kernel": ("fsdp", "tensor"), "mlp.up.bias": ("tensor",), "mlp.down.kernel": ("tensor", "fsdp"),
        "mlp.down.bias": ("fsdp",), "head.kernel": ("fsdp", "tensor"), "head.bias": ("tensor",),
    },
}
PATHS = ["head.bias", "head.kernel", "mlp.down.bias", "mlp.down.kernel", "mlp.up.bias", "mlp.up.kernel"]


@pytest.fixture(scope="module")
def eager_net():
    return make_net()


@pytest.fixture(scope="module")
def initialized():
    """sharded_init of the same factory on every mesh, plus one device."""
    out = {"one": nnxscale.sharded_init(make_net, nnxscale.make_mesh("data=1", devices=jax.devices()[:1]))}
    for mesh_spec in EXPECTED:
        out[mesh_spec] = nnxscale.sharded_init(make_net, nnxscale.make_mesh(mesh_spec))
    return out


# -------------------------------------------------------------------------------------
# specs and shardings
# -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_spec", list(EXPECTED))
def test_state_specs_and_shardings(eager_net, mesh_spec):
    mesh = nnxscale.make_mesh(mesh_spec)
    state = nnx.state(eager_net)
    specs = nnxscale.state_specs(eager_net, mesh)
    shardings = nnxscale.state_shardings(eager_net, mesh)
    var_structure = jax.tree.structure(state, is_leaf=_is_var)
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == var_structure
    assert jax.tree.structure(shardings) == var_structure
    # a State works as input too, and a plain {axis: size} mapping gives the same specs
    flat_specs = _flat(specs, lambda x: isinstance(x, P))
    assert _flat(nnxscale.state_specs(state, mesh), lambda x: isinstance(x, P)) == flat_specs
    assert _flat(nnxscale.state_specs(eager_net, dict(mesh.shape)), lambda x: isinstance(x, P)) == flat_specs
    flat_shardings = _flat(shardings)
    assert sorted(flat_specs) == PATHS
    for path in PATHS:
        assert _norm(flat_specs[path]) == EXPECTED[mesh_spec].get(path, ()), path
        assert isinstance(flat_shardings[path], NamedSharding)
        assert flat_shardings[path].mesh == mesh
        assert flat_shardings[path].spec == flat_specs[path]


def test_unannotated_linear_fallback():
    lin = nnx.Linear(16, 32, rngs=nnx.Rngs(0))

    def specs(mesh, rules_or_model=None):
        model = rules_or_model if isinstance(rules_or_model, nnx.Module) else lin
        rules = None if isinstance(rules_or_model, nnx.Module) else rules_or_model
        return {k: _norm(v) for k, v in _flat(nnxscale.state_specs(model, mesh, rules), lambda x: isinstance(x, P)).items()}

    assert specs({"data": 2, "model": 4}) == {"kernel": (None, "model"), "bias": ("model",)}
    assert specs({"model": 8}) == {"kernel": (None, "model"), "bias": ("model",)}
    assert specs({"data": 4, "tensor": 2}) == {"kernel": (None, "tensor"), "bias": ("tensor",)}
    assert specs({"data": 8}) == {"kernel": (), "bias": ()}
    assert specs({"fsdp": 8}) == {"kernel": ("fsdp",), "bias": ()}  # (embed, mlp): FSDP splits the rows
    # the preset decides, not the mesh alone: data parallel rules leave it whole on a model axis
    assert specs({"data": 2, "model": 4}, "dp") == {"kernel": (), "bias": ()}
    # the model axis does not divide 30: replicated rather than invalid
    assert specs({"data": 2, "model": 4}, nnx.Linear(16, 30, rngs=nnx.Rngs(0))) == {"kernel": (), "bias": ()}


# -------------------------------------------------------------------------------------
# sharded init: real shards on real devices, same numbers on every mesh
# -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_spec", list(EXPECTED))
def test_sharded_init_shard_shapes_on_every_device(initialized, mesh_spec):
    mesh = nnxscale.make_mesh(mesh_spec)
    model = initialized[mesh_spec]
    arrays = _arrays(model)
    assert sorted(arrays) == PATHS
    for path, arr in arrays.items():
        spec = EXPECTED[mesh_spec].get(path, ())
        assert _norm(arr.sharding.spec) == spec, path
        assert arr.sharding.mesh.shape == mesh.shape
        expected = nnxscale.shard_shape(arr.shape, P(*spec), mesh)
        shards = arr.addressable_shards
        assert sorted(s.device.id for s in shards) == list(range(8))
        for s in shards:
            assert s.data.shape == expected, (path, s.device)
            assert s.data.devices() == {s.device}


@pytest.mark.parametrize("mesh_spec", ["data=8", "model=8", "data=2,model=4", "data=4,model=2"])
def test_layout_invariance_same_seed_same_values(initialized, mesh_spec):
    reference = _values(initialized["one"])
    assert all(len(a.sharding.device_set) == 1 for a in _arrays(initialized["one"]).values())
    got = _values(initialized[mesh_spec])
    assert sorted(got) == sorted(reference)
    for path in reference:
        np.testing.assert_array_equal(got[path], reference[path], err_msg=path)
    # the test would notice a different seed
    assert not np.array_equal(reference["mlp.up.kernel"], _values(Net(nnx.Rngs(1)))["mlp.up.kernel"])


def test_sharded_init_model_is_callable(initialized):
    x = jax.random.normal(jax.random.key(1), (8, 16))
    single = np.asarray(initialized["one"](x))
    assert single.shape == (8, 32)
    out = initialized["data=2,model=4"](x)
    np.testing.assert_allclose(np.asarray(out), single, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------
# place and reshard
# -------------------------------------------------------------------------------------


def _assert_layout(model, mesh, rules=None):
    want = _flat(nnxscale.state_shardings(model, mesh, rules))
    for path, arr in _arrays(model).items():
        assert arr.sharding == want[path], path
        expected = nnxscale.shard_shape(arr.shape, want[path].spec, mesh)
        assert {s.data.shape for s in arr.addressable_shards} == {expected}
        assert len(arr.addressable_shards) == mesh.size


def test_place_and_reshard_keep_values_and_outputs(eager_net):
    x = jax.random.normal(jax.random.key(2), (8, 16))
    want_values = _values(eager_net)
    want_out = np.asarray(eager_net(x))

    mesh_a = nnxscale.make_mesh("data=2,model=4")
    placed = nnxscale.place(eager_net, mesh_a)
    assert isinstance(placed, Net)
    _assert_layout(placed, mesh_a)
    assert _norm(placed.mlp.up.kernel[...].sharding.spec) == (None, "model")

    mesh_b = nnxscale.make_mesh("fsdp=8")
    moved = nnxscale.reshard(placed, mesh_b)
    _assert_layout(moved, mesh_b)
    assert _norm(moved.mlp.up.kernel[...].sharding.spec) == ("fsdp",)

    represet = nnxscale.reshard(placed, mesh_a, "dp")
    assert _norm(represet.mlp.up.kernel[...].sharding.spec) == ()
    _assert_layout(represet, mesh_a, "dp")

    for model in (placed, moved, represet):
        got = _values(model)
        for path in want_values:
            np.testing.assert_array_equal(got[path], want_values[path], err_msg=path)
        np.testing.assert_allclose(np.asarray(model(x)), want_out, rtol=1e-5, atol=1e-5)
    # the source model is left where it was
    assert len(eager_net.mlp.up.kernel[...].sharding.device_set) == 1


def test_place_a_state_gives_a_state(eager_net):
    mesh = nnxscale.make_mesh("data=4,model=2")
    state = nnxscale.place(nnx.state(eager_net), mesh)
    assert isinstance(state, nnx.State)
    assert state["mlp"]["up"]["kernel"][...].sharding == NamedSharding(mesh, P(None, "model"))
    model = nnx.merge(nnx.graphdef(eager_net), state)
    np.testing.assert_array_equal(np.asarray(model.head.bias[...]), np.asarray(eager_net.head.bias[...]))


# -------------------------------------------------------------------------------------
# abstract state and bytes
# -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh_spec", ["data=2,model=4", "fsdp=8"])
def test_abstract_state_carries_target_shardings(eager_net, mesh_spec):
    mesh = nnxscale.make_mesh(mesh_spec)
    graphdef, state = nnxscale.abstract_state(make_net, mesh)
    assert graphdef == nnx.graphdef(eager_net)
    target = _flat(nnxscale.state_shardings(eager_net, mesh))
    real = _arrays(eager_net)
    variables = _flat(state, _is_var)
    assert sorted(variables) == PATHS
    for path, v in variables.items():
        leaf = v.get_value()
        assert isinstance(leaf, jax.ShapeDtypeStruct), path
        assert leaf.shape == real[path].shape and leaf.dtype == real[path].dtype
        assert leaf.sharding == target[path]


def _placed_bytes(model):
    per_device = {}
    for arr in jax.tree.leaves(nnx.state(model)):
        for s in arr.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    return max(per_device.values()), sum(a.nbytes for a in jax.tree.leaves(nnx.state(model)))


@pytest.mark.parametrize("mesh_spec", ["data=8", "data=2,model=4", "fsdp=8", "data=2,fsdp=2,tensor=2"])
def test_layout_bytes_matches_placed_arrays(initialized, mesh_spec):
    mesh = nnxscale.make_mesh(mesh_spec)
    model = initialized[mesh_spec]
    expected = _placed_bytes(model)
    assert nnxscale.layout_bytes(model, mesh) == expected
    assert nnxscale.layout_bytes(nnx.eval_shape(make_net), dict(mesh.shape)) == expected


class WithDropout(nnx.Module):
    """A model that keeps RNG state (as GPT-2 does for dropout)."""

    def __init__(self, rngs: nnx.Rngs):
        self.mlp = MLP(rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)


def test_layout_bytes_with_rng_state():
    mesh = nnxscale.make_mesh("data=2,model=4")
    model = nnxscale.place(WithDropout(nnx.Rngs(0)), mesh)
    # the RNG key and counter are replicated Variables: they count like any array
    assert nnxscale.layout_bytes(model, mesh) == _placed_bytes(model)
    table = nnxscale.sharding_table(model, mesh)
    assert table.per_device_bytes == _placed_bytes(model)[0]
    text = str(table)
    assert "drop.rngs.key" in text and "drop.rngs.count" in text
    assert nnxscale.lint(model, mesh, "batch=data,mlp=model,embed=") == []


# -------------------------------------------------------------------------------------
# Flax-annotated models (nnx.with_partitioning): the second source of logical axes
# -------------------------------------------------------------------------------------


def _flax_linear():
    kernel_init = nnx.with_partitioning(_init, (None, "model"))
    return nnx.Linear(16, 32, kernel_init=kernel_init, bias_init=_bias, rngs=nnx.Rngs(0))


def test_flax_annotated_model_specs():
    mesh = nnxscale.make_mesh("data=2,model=4")
    with jax.set_mesh(mesh):
        lin = _flax_linear()
        both = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(_init, (("data", "model"), None)), rngs=nnx.Rngs(0))
    assert _norm(nnxscale.state_specs(lin, mesh)["kernel"]) == (None, "model")
    # a tuple entry names two mesh axes; each name maps to itself, as Flax means it
    assert _norm(nnxscale.state_specs(both, mesh)["kernel"]) == (("data", "model"),)


def test_sharded_init_of_flax_annotated_model():
    mesh = nnxscale.make_mesh("data=2,model=4")
    model = nnxscale.sharded_init(_flax_linear, mesh)
    kernel = model.kernel[...]
    assert _norm(kernel.sharding.spec) == (None, "model")
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 8)}


# -------------------------------------------------------------------------------------
# lint
# -------------------------------------------------------------------------------------


def _kinds(findings):
    return {(f.kind, f.path) for f in findings}


def test_lint_unused_rule_and_no_rule():
    mesh = nnxscale.make_mesh("data=2,model=4")
    model = MLP(nnx.Rngs(0))
    findings = nnxscale.lint(model, mesh, "batch=data,mlp=model,vocab=model,embed=")
    unused = [f for f in findings if f.kind == "unused-rule"]
    assert len(unused) == 1 and "'vocab'" in unused[0].message
    assert findings == unused  # batch is an activation name: not reported

    odd = nnx.Linear(16, 64, kernel_init=L(_init, "foo", "mlp"), bias_init=L(_bias, "mlp"), rngs=nnx.Rngs(0))
    findings = nnxscale.lint(odd, mesh, "batch=data,mlp=model")
    assert _kinds(findings) == {("no-rule", "kernel")}
    assert "'foo'" in findings[0].message
    assert "no-rule" in str(findings[0]) and "kernel" in str(findings[0])


def test_lint_axis_reused():
    mesh = nnxscale.make_mesh("model=8")
    model = MLP(nnx.Rngs(0))
    rules = "embed=model,mlp=model"
    findings = nnxscale.lint(model, mesh, rules)
    assert {("axis-reused", "up.kernel"), ("axis-reused", "down.kernel")} <= _kinds(findings)
    assert all("'model'" in f.message for f in findings if f.kind == "axis-reused")
    specs = nnxscale.state_specs(model, mesh, rules)
    # the spec stays valid: the second use is dropped
    assert _norm(specs["up"]["kernel"]) == ("model",)
    assert _norm(specs["down"]["kernel"]) == ("model",)
    nnxscale.place(model, mesh, rules)


def test_lint_indivisible():
    mesh = nnxscale.make_mesh("model=8")
    model = nnx.Linear(16, 12, kernel_init=L(_init, "embed", "mlp"), bias_init=L(_bias, "mlp"), rngs=nnx.Rngs(0))
    findings = nnxscale.lint(model, mesh, "batch=data,mlp=model,embed=")
    assert _kinds(findings) == {("indivisible", "kernel"), ("indivisible", "bias")}
    for f in findings:
        assert "12" in f.message and "8" in f.message and "model" in f.message
    assert _norm(nnxscale.state_specs(model, mesh, "tp")["kernel"]) == ()
    nnxscale.place(model, mesh, "tp")


def test_lint_unannotated():
    mesh = nnxscale.make_mesh("data=2,model=4")
    findings = nnxscale.lint(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), mesh, "batch=data,mlp=model")
    assert _kinds(findings) == {("unannotated", "kernel"), ("unannotated", "bias")}
    kernel = next(f for f in findings if f.path == "kernel")
    assert "('embed', 'mlp')" in kernel.message and "P(None, 'model')" in kernel.message
    # the rules decide: without an mlp rule the fallback replicates
    findings = nnxscale.lint(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), mesh, "batch=data")
    assert _kinds(findings) == {("unannotated", "kernel"), ("unannotated", "bias")}
    assert all("P(None, None)" in f.message or "P(None,)" in f.message for f in findings), findings


def test_lint_replicated_above_threshold():
    mesh = nnxscale.make_mesh("data=8")
    big = nnx.eval_shape(
        lambda: nnx.Linear(1024, 512, kernel_init=L(_init, "embed", "mlp"), bias_init=L(_bias, "mlp"), rngs=nnx.Rngs(0))
    )
    rules = "batch=data,embed=,mlp="  # replicate on purpose: no no-rule findings
    findings = nnxscale.lint(big, mesh, rules)  # 2 MiB kernel on every device; the 2 KiB bias is fine
    assert _kinds(findings) == {("replicated", "kernel")}
    assert "8" in findings[0].message
    assert nnxscale.lint(big, mesh, rules, replicated_threshold_bytes=4 << 20) == []
    one = nnxscale.make_mesh("data=1", devices=jax.devices()[:1])
    assert nnxscale.lint(big, one, rules) == []  # nothing to gain on one device


class Clean(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 32, embedding_init=L(_bias, "vocab", "embed"), rngs=rngs)
        self.attn = nnx.LinearGeneral(
            32, (8, 4), kernel_init=L(_init, "embed", "heads", None), bias_init=L(_bias, "heads", None), rngs=rngs
        )
        self.mlp = MLP(rngs, d=32, h=64)


def test_lint_clean_model_reports_nothing():
    assert nnxscale.lint(Clean(nnx.Rngs(0)), nnxscale.make_mesh("data=2,fsdp=2,tensor=2"), "auto") == []
    assert nnxscale.lint(MLP(nnx.Rngs(0)), {"data": 2, "fsdp": 2, "model": 2}, "batch=data,embed=fsdp,mlp=model") == []


# -------------------------------------------------------------------------------------
# sharding table
# -------------------------------------------------------------------------------------


def test_sharding_table(initialized):
    mesh = nnxscale.make_mesh("data=2,model=4")
    model = initialized["data=2,model=4"]
    table = nnxscale.sharding_table(model, mesh)
    assert [r.path for r in table.rows] == [lay.path for lay in nnxscale.layouts(model, mesh)]
    assert sorted(r.path for r in table.rows) == PATHS
    per_device, full = _placed_bytes(model)
    assert table.per_device_bytes == per_device == nnxscale.layout_bytes(model, mesh)[0]
    assert table.total_bytes == full
    assert table.num_params == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    text = str(table)
    for path in PATHS:
        assert path in text
    assert "data=2,model=4" in text
    assert f"{table.num_params:,}" in text
    # abstract models give the same table
    abstract = nnxscale.sharding_table(nnx.eval_shape(make_net), dict(mesh.shape))
    assert (abstract.per_device_bytes, abstract.total_bytes, abstract.num_params) == (
        table.per_device_bytes,
        table.total_bytes,
        table.num_params,
    )


# -------------------------------------------------------------------------------------
# sharded init memory: a guarantee about the compiled program, not a timing
# -------------------------------------------------------------------------------------


def test_compile_init_memory_is_a_few_shards():
    """The issue's guarantee: a model of a few large Linear layers initializes in at most 4x its shard."""
    mesh = nnxscale.make_mesh("model=8")

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [nnx.Linear(1024, 4096, kernel_init=L(_init, "embed", "mlp"), rngs=rngs) for _ in range(4)]
            )

    def factory():
        return Stack(nnx.Rngs(0))

    shard = nnxscale.layout_bytes(nnx.eval_shape(factory), mesh)[0]
    assert shard == 4 * (1024 * 4096 + 4096) // 8 * 4  # kernels by rule, biases by the rank fallback P("model")
    for group_bytes in (nnxscale.sharding.state.INIT_GROUP_BYTES, 1 << 40):  # grouped, and one program
        mem = nnxscale.compile_init(factory, mesh, group_bytes=group_bytes).memory()
        assert shard <= mem["output"] <= shard + 1024  # plus XLA's output tuple tables
        assert mem["peak"] <= 4 * shard, (group_bytes, mem)
    # Groups of about one layer keep the peak well under the single program's.
    grouped = nnxscale.compile_init(factory, mesh, group_bytes=shard // 4).memory()
    single = nnxscale.compile_init(factory, mesh, group_bytes=1 << 40).memory()
    assert grouped["programs"] == 4 and single["programs"] == 1
    assert grouped["peak"] < single["peak"]


def test_grouped_init_gives_the_same_values():
    mesh = nnxscale.make_mesh("data=2,model=4")

    def factory():
        return make_net()

    one = nnx.state(nnxscale.sharded_init(factory, mesh, group_bytes=1 << 40))
    many = nnx.state(nnxscale.sharded_init(factory, mesh, group_bytes=1))  # one Variable per program
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(many), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
