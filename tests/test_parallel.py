"""shard_map data parallel and Megatron tensor-parallel layers on 8 simulated CPU devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnxscale
from nnxscale.teaching.shard_map import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelMLP,
    data_parallel_apply,
)

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def meshes():
    return {spec: nnxscale.make_mesh(spec) for spec in ("data=8", "model=8", "data=2,model=4")}


def _x(shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape)


def _shard_shapes(arr):
    return {tuple(s.data.shape) for s in arr.addressable_shards}


def _devices(arr):
    return {s.device for s in arr.addressable_shards}


class MLP(nnx.Module):
    def __init__(self, din, dhidden, dout, *, rngs):
        self.fc1 = nnx.Linear(din, dhidden, rngs=rngs)
        self.fc2 = nnx.Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


# -- data parallel ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, axis, n",
    [("data=8", "data", 8), ("data=2,model=4", ("data",), 2)],
)
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_data_parallel_apply_equals_unsharded_call(meshes, spec, axis, n, kind):
    mesh = meshes[spec]
    model = nnx.Linear(16, 12, rngs=nnx.Rngs(0)) if kind == "linear" else MLP(16, 32, 12, rngs=nnx.Rngs(0))
    x = _x((32, 16))
    out = data_parallel_apply(model, x, mesh, axis=axis)
    np.testing.assert_allclose(out, model(x), **TOL)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), out.ndim)
    assert _shard_shapes(out) == {(32 // n, 12)}
    assert _devices(out) == set(mesh.devices.flat)


def test_data_parallel_apply_over_two_axes(meshes):
    mesh = meshes["data=2,model=4"]
    model = nnx.Linear(16, 12, rngs=nnx.Rngs(0))
    x = _x((32, 16))
    out = data_parallel_apply(model, x, mesh, axis=("data", "model"))
    np.testing.assert_allclose(out, model(x), **TOL)
    assert _shard_shapes(out) == {(4, 12)}  # 32 rows over 2*4 devices


def test_data_parallel_apply_under_jit(meshes):
    mesh = meshes["data=8"]
    model = MLP(16, 32, 12, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(model)
    x = _x((16, 16))

    @jax.jit
    def apply(state, x):
        return data_parallel_apply(nnx.merge(graphdef, state), x, mesh)

    out = apply(state, x)
    np.testing.assert_allclose(out, model(x), **TOL)
    assert _shard_shapes(out) == {(2, 12)}


def test_data_parallel_apply_hosts_tensor_parallel_module(meshes):
    """DP over data, TP over model: the TP layer's shard_map nests inside the DP one."""
    mesh = meshes["data=2,model=4"]
    mlp = TensorParallelMLP(16, 32, mesh=mesh, rngs=nnx.Rngs(0))
    x = _x((8, 16))
    out = data_parallel_apply(mlp, x, mesh, axis="data")
    np.testing.assert_allclose(out, _mlp_reference(_weights(mlp), x), **TOL)
    assert _shard_shapes(out) == {(4, 16)}


def test_data_parallel_apply_rejects_indivisible_batch(meshes):
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"batch size 30 .* 8 shards .*data=8"):
        data_parallel_apply(model, _x((30, 4)), meshes["data=8"])
    with pytest.raises(ValueError, match=r"batch size 6 .* 4 shards"):
        data_parallel_apply(model, _x((6, 4)), meshes["data=2,model=4"], axis="model")


def test_data_parallel_apply_rejects_unknown_axis(meshes):
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"'batch' is not an axis of the mesh, which has axes \('data', 'model'\)"):
        data_parallel_apply(model, _x((8, 4)), meshes["data=2,model=4"], axis="batch")
    with pytest.raises(ValueError, match=r"'model' is not an axis .* \('data',\)"):
        data_parallel_apply(model, _x((8, 4)), meshes["data=8"], axis=("data", "model"))


# -- tensor parallel -------------------------------------------------------------------

TP_MESHES = ["model=8", "data=2,model=4"]


def _np(v):
    return np.asarray(v[...])


def _weights(mlp):
    return dict(wu=_np(mlp.up.kernel), bu=_np(mlp.up.bias), wd=_np(mlp.down.kernel), bd=_np(mlp.down.bias))


def _mlp_reference(w, x):
    """The unsharded Megatron MLP: the same weights on one device, plain jnp."""
    return jax.nn.gelu(x @ w["wu"] + w["bu"]) @ w["wd"] + w["bd"]


@pytest.mark.parametrize("spec", TP_MESHES)
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_equals_unsharded(meshes, spec, gather_output):
    mesh = meshes[spec]
    n = mesh.shape["model"]
    layer = ColumnParallelLinear(16, 32, mesh=mesh, gather_output=gather_output, rngs=nnx.Rngs(0))
    x = _x((4, 16))
    y = layer(x)
    np.testing.assert_allclose(y, x @ _np(layer.kernel) + _np(layer.bias), **TOL)
    if gather_output:
        assert _shard_shapes(y) == {(4, 32)}  # all_gather: the full output everywhere
    else:
        assert _shard_shapes(y) == {(4, 32 // n)}  # each device keeps its column slice
        assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), y.ndim)


@pytest.mark.parametrize("spec", TP_MESHES)
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_equals_unsharded(meshes, spec, input_is_parallel):
    mesh = meshes[spec]
    layer = RowParallelLinear(32, 16, mesh=mesh, input_is_parallel=input_is_parallel, rngs=nnx.Rngs(0))
    layer.bias[...] = jnp.arange(16.0)  # a nonzero bias: it must be added once, not n times
    h = _x((2, 3, 32))  # any leading dims
    y = layer(h)
    np.testing.assert_allclose(y, h @ _np(layer.kernel) + np.arange(16.0), **TOL)
    assert _shard_shapes(y) == {(2, 3, 16)}


def test_layers_without_bias(meshes):
    mesh = meshes["model=8"]
    col = ColumnParallelLinear(16, 32, mesh=mesh, use_bias=False, rngs=nnx.Rngs(0))
    row = RowParallelLinear(32, 16, mesh=mesh, use_bias=False, rngs=nnx.Rngs(1))
    assert col.bias is None and row.bias is None
    x = _x((4, 16))
    np.testing.assert_allclose(row(col(x)), x @ _np(col.kernel) @ _np(row.kernel), **TOL)


def test_weights_match_nnx_linear_for_the_same_rngs(meshes):
    mesh = meshes["data=2,model=4"]
    ref = nnx.Linear(16, 32, rngs=nnx.Rngs(7))
    for layer in (
        ColumnParallelLinear(16, 32, mesh=mesh, rngs=nnx.Rngs(7)),
        RowParallelLinear(16, 32, mesh=mesh, rngs=nnx.Rngs(7)),
    ):
        np.testing.assert_array_equal(_np(layer.kernel), _np(ref.kernel))
        np.testing.assert_array_equal(_np(layer.bias), _np(ref.bias))


@pytest.mark.parametrize("spec", TP_MESHES)
def test_kernel_shard_shapes_per_device(meshes, spec):
    mesh = meshes[spec]
    n = mesh.shape["model"]
    col = ColumnParallelLinear(16, 32, mesh=mesh, rngs=nnx.Rngs(0))
    row = RowParallelLinear(32, 16, mesh=mesh, rngs=nnx.Rngs(0))
    assert _shard_shapes(col.kernel[...]) == {(16, 32 // n)}
    assert _shard_shapes(col.bias[...]) == {(32 // n,)}
    assert _shard_shapes(row.kernel[...]) == {(32 // n, 16)}
    assert _shard_shapes(row.bias[...]) == {(16,)}
    for arr in (col.kernel[...], row.kernel[...]):
        assert _devices(arr) == set(mesh.devices.flat)
    # the layout is also recorded as Flax metadata, so sharding tools see it
    specs = nnx.get_partition_spec(nnx.state(col))
    assert specs["kernel"].get_value() == P(None, "model")
    assert specs["bias"].get_value() == P("model")


def _count(jaxpr_text, name):
    """How many equations apply a primitive whose name starts with ``name`` (psum_invariant...)."""
    return len(re.findall(rf"\b{name}\w*\[", jaxpr_text))


def test_collectives_in_the_forward_pass(meshes):
    mesh = meshes["model=8"]
    x, h = _x((4, 16)), _x((4, 32))
    col = ColumnParallelLinear(16, 32, mesh=mesh, rngs=nnx.Rngs(0))
    col_g = ColumnParallelLinear(16, 32, mesh=mesh, gather_output=True, rngs=nnx.Rngs(0))
    row = RowParallelLinear(32, 16, mesh=mesh, rngs=nnx.Rngs(0))
    mlp = TensorParallelMLP(16, 32, mesh=mesh, rngs=nnx.Rngs(0))

    text = {name: str(jax.make_jaxpr(f)(a)) for name, f, a in [
        ("col", col, x), ("col_g", col_g, x), ("row", row, h), ("mlp", mlp, x)
    ]}
    for name in text:
        assert "shard_map" in text[name]
    assert _count(text["col"], "psum") == 0 and _count(text["col"], "all_gather") == 0
    assert _count(text["col_g"], "psum") == 0 and _count(text["col_g"], "all_gather") == 1
    assert _count(text["row"], "psum") == 1 and _count(text["row"], "all_gather") == 0
    assert _count(text["mlp"], "psum") == 1 and _count(text["mlp"], "all_gather") == 0


@pytest.mark.parametrize("spec", TP_MESHES)
def test_tensor_parallel_mlp_equals_unsharded(meshes, spec):
    mesh = meshes[spec]
    mlp = TensorParallelMLP(16, 64, mesh=mesh, rngs=nnx.Rngs(0))
    mlp.down.bias[...] = jnp.linspace(-1.0, 1.0, 16)
    x = _x((8, 16))
    y = mlp(x)
    np.testing.assert_allclose(y, _mlp_reference(_weights(mlp), x), **TOL)
    # the composed layers give the same answer as the fused shard_map
    np.testing.assert_allclose(mlp.down(jax.nn.gelu(mlp.up(x))), y, **TOL)


@pytest.mark.parametrize("spec", TP_MESHES)
def test_tensor_parallel_mlp_gradients_equal_unsharded(meshes, spec):
    mesh = meshes[spec]
    mlp = TensorParallelMLP(16, 64, mesh=mesh, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(mlp, nnx.Param)
    x, target = _x((8, 16)), _x((8, 16), seed=2)

    def loss(params, x):
        return jnp.mean((nnx.merge(graphdef, params)(x) - target) ** 2)

    def ref_loss(w, x):
        return jnp.mean((_mlp_reference(w, x) - target) ** 2)

    grads, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    ref, ref_gx = jax.grad(ref_loss, argnums=(0, 1))(_weights(mlp), x)
    got = dict(
        wu=grads["up"]["kernel"][...], bu=grads["up"]["bias"][...],
        wd=grads["down"]["kernel"][...], bd=grads["down"]["bias"][...],
    )
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-4, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(gx, ref_gx, rtol=1e-4, atol=1e-6)
    # gradients come back in the parameters' own layout
    n = mesh.shape["model"]
    assert _shard_shapes(got["wu"]) == {(16, 64 // n)}
    assert _shard_shapes(got["wd"]) == {(64 // n, 16)}


def test_indivisible_feature_sizes_are_rejected(meshes):
    mesh = meshes["model=8"]
    with pytest.raises(ValueError, match=r"out_features=12 is not divisible by the 8 shards .*model=8"):
        ColumnParallelLinear(16, 12, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"in_features=18 is not divisible by the 4 shards .*model=4"):
        RowParallelLinear(18, 16, mesh=meshes["data=2,model=4"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"d_hidden=36 is not divisible by the 8 shards"):
        TensorParallelMLP(16, 36, mesh=mesh, rngs=nnx.Rngs(0))


def test_unknown_axis_and_wrong_input_width_are_rejected(meshes):
    with pytest.raises(ValueError, match=r"'model' is not an axis of the mesh, which has axes \('data',\)"):
        ColumnParallelLinear(16, 32, mesh=meshes["data=8"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"'tensor' is not an axis .* \('data', 'model'\)"):
        RowParallelLinear(16, 32, mesh=meshes["data=2,model=4"], axis="tensor", rngs=nnx.Rngs(0))
    col = ColumnParallelLinear(16, 32, mesh=meshes["model=8"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"shape \(4, 15\) .* in_features=16"):
        col(_x((4, 15)))


@pytest.mark.parametrize("layer_cls, spec", [(ColumnParallelLinear, P(None, "model")), (RowParallelLinear, P("model", None))])
def test_kernel_is_created_in_its_shards(meshes, layer_cls, spec):
    """The jitted initializer never holds the full kernel: XLA partitions the generation."""
    from nnxscale.teaching.shard_map import _default_kernel_init, _initializer

    mesh = meshes["model=8"]
    layer = layer_cls(1024, 2048, mesh=mesh, rngs=nnx.Rngs(0))
    kernel = layer.kernel[...]
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
    create = _initializer(_default_kernel_init, (1024, 2048), jnp.float32, NamedSharding(mesh, spec))  # the layer's
    mem = create.lower(jax.random.key(0)).compile().memory_analysis()
    full = 1024 * 2048 * 4
    assert mem.output_size_in_bytes == full // 8
    # unpartitioned generation needs the full kernel (several times over) in temp space
    assert mem.temp_size_in_bytes + mem.output_size_in_bytes < full


def test_nnxscale_sharding_sees_the_tensor_parallel_layout(meshes):
    """state_specs (used by place, reshard and checkpoint restore) reads the layers' layout."""
    mesh = meshes["data=2,model=4"]
    mlp = TensorParallelMLP(16, 32, mesh=mesh, rngs=nnx.Rngs(0))
    specs = nnxscale.state_specs(mlp, mesh)
    for layer, name in [(mlp.up, "up"), (mlp.down, "down")]:
        for param in ("kernel", "bias"):
            value = getattr(layer, param)[...]
            spec = specs[name][param]
            spec = spec.get_value() if isinstance(spec, nnx.Variable) else spec
            assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim), (name, param, spec)


def test_layers_compute_on_the_mesh_their_parameters_were_moved_to(meshes):
    mlp = TensorParallelMLP(16, 64, mesh=meshes["data=2,model=4"], axis="model", rngs=nnx.Rngs(0))
    x = _x((4, 16))
    want = np.asarray(mlp(x))
    moved = nnxscale.reshard(mlp, meshes["model=8"])
    assert _shard_shapes(moved.up.kernel[...]) == {(16, 8)}
    eager = moved(x)
    assert dict(eager.sharding.mesh.shape) == {"model": 8}  # not pulled back to data=2,model=4
    np.testing.assert_allclose(eager, want, **TOL)
    graphdef = nnx.graphdef(moved)
    jitted = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(nnx.state(moved), x)
    assert dict(jitted.sharding.mesh.shape) == {"model": 8}
    np.testing.assert_allclose(jitted, want, **TOL)
    # a mesh without the layer's axis: a clear error, not a silent move back
    replicated = nnxscale.reshard(mlp, meshes["data=8"])
    with pytest.raises(nnxscale.LayoutError, match="lacks its axis 'model'"):
        replicated(x)
