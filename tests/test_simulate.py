"""Each single-device simulation against the real multi-device API on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnxscale
from nnxscale.teaching.simulate import (
    mesh_init_simulate,
    partition_spec_layout,
    shard_map_simulate,
    spec_tree,
    state_to_sharded_layout,
)


@pytest.fixture(scope="module")
def meshes():
    return {spec: nnxscale.make_mesh(spec) for spec in ("data=8", "model=8", "data=2,model=4", "data=4,model=2")}


def _x(shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape)


def _is_1d_float(a, n):
    return isinstance(a, jax.Array) and a.shape == (n,) and jnp.issubdtype(a.dtype, jnp.floating)


def _shard_shapes(arr):
    return {tuple(s.data.shape) for s in arr.addressable_shards}


# -- 4. shard_map_simulate vs jax.shard_map --------------------------------------------


@pytest.mark.parametrize("spec", ["data=8", "data=4,model=2"])
def test_shard_map_simulate_equals_real_shard_map(meshes, spec):
    mesh = meshes[spec]
    n = mesh.shape["data"]
    seed, features = 3, 5
    x = _x((16, 6))

    model = nnx.Linear(6, features, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    real = jax.shard_map(
        lambda state, x: nnx.merge(graphdef, state)(x),  # each device: its (16/n, 6) rows
        mesh=mesh,
        in_specs=(P(), P("data")),  # params replicated, batch split
        out_specs=P("data"),  # outputs concatenated along the batch
    )(state, x)
    assert _shard_shapes(real) == {(16 // n, features)}

    sim = shard_map_simulate(float(seed), x, float(n), float(features))
    assert _is_1d_float(sim, 16 * features)
    np.testing.assert_allclose(sim, real.reshape(-1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sim, nnxscale.data_parallel_apply(model, x, mesh).reshape(-1), rtol=1e-6, atol=1e-6)


def test_shard_map_simulate_builds_one_model_for_all_shards():
    """Every chunk uses the same parameters: the result equals one call on the whole batch."""
    x = _x((12, 4))
    sim = shard_map_simulate(7.0, x, 3.0, 2.0)
    whole = nnx.Linear(4, 2, rngs=nnx.Rngs(7))(x)
    np.testing.assert_allclose(sim, whole.reshape(-1), rtol=1e-6, atol=1e-6)
    assert not np.allclose(sim, shard_map_simulate(8.0, x, 3.0, 2.0))  # the seed matters


def test_shard_map_simulate_rejects_uneven_and_non_positive():
    x = _x((10, 4))
    with pytest.raises(ValueError, match=r"N=10 .* num_shards=3"):
        shard_map_simulate(0.0, x, 3.0, 2.0)
    with pytest.raises(ValueError, match="num_shards"):
        shard_map_simulate(0.0, x, 0.0, 2.0)
    with pytest.raises(ValueError, match="features"):
        shard_map_simulate(0.0, x, 2.0, -1.0)
    with pytest.raises(ValueError, match="2-D"):
        shard_map_simulate(0.0, x.reshape(-1), 2.0, 2.0)


# -- 3. partition_spec_layout vs NamedSharding.shard_shape -----------------------------


@pytest.mark.parametrize("spec", ["model=8", "data=2,model=4", "data=4,model=2"])
@pytest.mark.parametrize("kernel_in, kernel_out", [(16, 64), (3, 8)])
def test_partition_spec_layout_equals_named_sharding(meshes, spec, kernel_in, kernel_out):
    mesh = meshes[spec]
    n = mesh.shape["model"]
    got = partition_spec_layout(float(n), float(kernel_in), float(kernel_out))
    assert _is_1d_float(got, 2)
    real = NamedSharding(mesh, P(None, "model")).shard_shape((kernel_in, kernel_out))
    assert tuple(int(v) for v in got) == real == (kernel_in, kernel_out // n)


def test_partition_spec_layout_matches_placed_array(meshes):
    mesh = meshes["data=2,model=4"]
    kernel = jax.device_put(jnp.zeros((6, 32)), NamedSharding(mesh, P(None, "model")))
    got = partition_spec_layout(4.0, 6.0, 32.0)
    assert _shard_shapes(kernel) == {tuple(int(v) for v in got)}


def test_partition_spec_layout_rejects_uneven_and_non_positive():
    with pytest.raises(ValueError, match=r"kernel_out=10 is not divisible by num_devices=4"):
        partition_spec_layout(4.0, 8.0, 10.0)
    for args in [(0.0, 8.0, 16.0), (-2.0, 8.0, 16.0), (2.0, 0.0, 16.0), (2.0, 8.0, -16.0)]:
        with pytest.raises(ValueError, match="positive"):
            partition_spec_layout(*args)


# -- 1. mesh_init_simulate vs init under a real mesh -----------------------------------


def _real_sharded_linear_state(mesh, seed, in_dim, features):
    """The production pattern: create the Linear's state under jit, directly in its shards."""
    abstract = nnx.state(nnx.eval_shape(lambda: nnx.Linear(in_dim, features, rngs=nnx.Rngs(seed))))
    shardings = jax.tree_util.tree_map(
        lambda spec: NamedSharding(mesh, spec), spec_tree(abstract), is_leaf=lambda v: isinstance(v, P)
    )
    with jax.set_mesh(mesh):
        return jax.jit(lambda: nnx.state(nnx.Linear(in_dim, features, rngs=nnx.Rngs(seed))), out_shardings=shardings)()


@pytest.mark.parametrize("seed, features", [(0, 16), (5, 8)])
def test_mesh_init_simulate_matches_init_under_a_real_mesh(meshes, seed, features):
    mesh = meshes["model=8"]
    x = _x((4, 12))
    got = mesh_init_simulate(float(seed), x, float(features), 8.0)
    assert _is_1d_float(got, 3)
    assert got.tolist() == [features, 8.0, 2.0]

    sharded = _real_sharded_linear_state(mesh, seed, 12, features)
    assert len(jax.tree_util.tree_leaves(sharded)) == int(got[2])
    assert _shard_shapes(sharded["kernel"][...]) == {(12, features // 8)}
    assert _shard_shapes(sharded["bias"][...]) == {(features // 8,)}
    # same build line, same values: only where the arrays live differs
    plain = nnx.state(nnx.Linear(12, features, rngs=nnx.Rngs(seed)))
    for a, b in zip(jax.tree_util.tree_leaves(sharded), jax.tree_util.tree_leaves(plain)):
        np.testing.assert_array_equal(a, b)


def test_mesh_init_simulate_matches_sharded_init(meshes):
    mesh = meshes["data=2,model=4"]
    seed, features = 2, 8
    got = mesh_init_simulate(float(seed), _x((3, 6)), float(features), 4.0)
    model = nnxscale.sharded_init(lambda: nnx.Linear(6, features, rngs=nnx.Rngs(seed)), mesh)
    state = nnx.state(model)
    assert len(jax.tree_util.tree_leaves(state)) == int(got[2])
    plain = nnx.state(nnx.Linear(6, features, rngs=nnx.Rngs(seed)))
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(plain)):
        np.testing.assert_array_equal(a, b)


def test_mesh_init_simulate_rejects_non_positive():
    with pytest.raises(ValueError, match="features"):
        mesh_init_simulate(0.0, _x((2, 3)), 0.0, 8.0)
    with pytest.raises(ValueError, match="mesh_axes"):
        mesh_init_simulate(0.0, _x((2, 3)), 4.0, -8.0)


# -- 2. state_to_sharded_layout vs placing the state -----------------------------------


def test_state_to_sharded_layout_counts_specs_not_their_entries(meshes):
    x = _x((4, 12))
    got = state_to_sharded_layout(0.0, x, 16.0)
    assert _is_1d_float(got, 1)
    assert got.tolist() == [2.0]

    _, state = nnx.split(nnx.Linear(12, 16, rngs=nnx.Rngs(0)))
    specs = jax.tree_util.tree_leaves(spec_tree(state), is_leaf=lambda v: isinstance(v, P))
    assert sorted(specs, key=len) == [P("model"), P(None, "model")]


def test_state_to_sharded_layout_spec_tree_places_the_state(meshes):
    mesh = meshes["model=8"]
    _, state = nnx.split(nnx.Linear(12, 16, rngs=nnx.Rngs(0)))
    shardings = jax.tree_util.tree_map(
        lambda spec: NamedSharding(mesh, spec), spec_tree(state), is_leaf=lambda v: isinstance(v, P)
    )
    placed = jax.device_put(state, shardings)
    assert _shard_shapes(placed["kernel"][...]) == {(12, 2)}
    assert _shard_shapes(placed["bias"][...]) == {(2,)}
    np.testing.assert_array_equal(placed["kernel"][...], state["kernel"][...])


def test_float_arguments_and_return_types():
    x = _x((6, 4))
    assert _is_1d_float(mesh_init_simulate(1.0, x, 3.0, 2.0), 3)
    assert _is_1d_float(state_to_sharded_layout(1.0, x, 3.0), 1)
    assert partition_spec_layout(4.0, 3.0, 8.0).tolist() == [3.0, 2.0]
    out = shard_map_simulate(1.0, x, 3.0, 5.0)
    assert _is_1d_float(out, 6 * 5)
    # a numpy input works too, and the seed cast with int() (1.0 -> 1)
    np.testing.assert_allclose(shard_map_simulate(1, np.asarray(x), 3, 5), out, rtol=1e-6)
