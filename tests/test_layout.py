"""shard_shape and byte arithmetic agree with what JAX actually does, with or without devices."""

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import nnxscale
from nnxscale.sharding.layout import LayoutError

MESHES = ["data=8", "model=8", "data=2,model=4", "data=4,model=2", "data=2,fsdp=2,tensor=2"]

# Dimensions chosen so that some specs divide and some do not.
SHAPES = [(), (8,), (12,), (16, 8), (6, 16), (2, 4, 16), (24, 16, 32), (8, 2, 4, 4), (64, 8, 16)]


def _entries(axes):
    """Every PartitionSpec entry over these axes: None, a name, a 1-tuple, an ordered pair."""
    out = [None]
    out += list(axes)
    out += [(a,) for a in axes]
    out += list(itertools.permutations(axes, 2))
    return out


def _entry_axes(e):
    return () if e is None else (e,) if isinstance(e, str) else tuple(e)


def _specs(axes, rank):
    """All specs of length 0..rank that use each mesh axis at most once."""
    for length in range(rank + 1):
        for combo in itertools.product(_entries(axes), repeat=length):
            used = [a for e in combo for a in _entry_axes(e)]
            if len(used) == len(set(used)):
                yield P(*combo)


@pytest.mark.parametrize("as_dict", [False, True], ids=["Mesh", "dict"])
@pytest.mark.parametrize("mesh_spec", MESHES)
def test_shard_shape_agrees_with_jax(mesh_spec, as_dict):
    mesh = nnxscale.make_mesh(mesh_spec)
    target = dict(mesh.shape) if as_dict else mesh
    accepted = rejected = 0
    for shape in SHAPES:
        for spec in _specs(mesh.axis_names, min(len(shape), 3)):
            try:
                expected = NamedSharding(mesh, spec).shard_shape(shape)
            except ValueError:  # JAX rejects: the dimension does not divide
                with pytest.raises(LayoutError):
                    nnxscale.shard_shape(shape, spec, target)
                rejected += 1
                continue
            got = nnxscale.shard_shape(shape, spec, target)
            assert got == tuple(expected), (shape, spec, mesh_spec)
            # the same spec written as a plain tuple of entries
            assert nnxscale.shard_shape(shape, tuple(spec), target) == got
            accepted += 1
    # the generator really covers both outcomes
    assert accepted > 50 and rejected > 10


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_replicated_and_short_specs(mesh_spec):
    mesh = nnxscale.make_mesh(mesh_spec)
    for shape in [(7,), (3, 5), (9, 8, 7)]:
        assert nnxscale.shard_shape(shape, P(), mesh) == shape
        assert nnxscale.shard_shape(shape, None, mesh) == shape
        assert nnxscale.shard_shape(shape, P(None), mesh) == NamedSharding(mesh, P(None)).shard_shape(shape)
    first = mesh.axis_names[0]
    shape = (16, 3, 5)
    assert nnxscale.shard_shape(shape, P(first), mesh) == NamedSharding(mesh, P(first)).shard_shape(shape)


PLANNING_CASES = [
    ((1 << 20, 65536), P("data", "model")),
    ((50304, 12288), P("model", None)),
    ((96, 12288, 49152), P(None, "data", "model")),
    ((12288, 49152), P(None, ("data", "model"))),
    ((8192,), P()),
]


@pytest.mark.parametrize("shape, spec", PLANNING_CASES)
def test_planning_for_a_pod_that_does_not_exist_here(shape, spec):
    pod = {"data": 64, "model": 16}  # 1024 chips
    reference = NamedSharding(AbstractMesh((64, 16), ("data", "model")), spec).shard_shape(shape)
    assert nnxscale.shard_shape(shape, spec, pod) == tuple(reference)
    for dtype in (jnp.float32, jnp.bfloat16, np.int8):
        itemsize = np.dtype(dtype).itemsize
        assert nnxscale.shard_bytes(shape, dtype, spec, pod) == math.prod(reference) * itemsize
        assert nnxscale.full_bytes(shape, dtype) == math.prod(shape) * itemsize


def test_planning_a_big_tensor_is_exact():
    # 2**40 float32 elements (4 TiB): Python ints, no overflow, no allocation
    shape = (1 << 20, 1 << 20)
    per_device = nnxscale.shard_bytes(shape, jnp.float32, P("data", "model"), {"data": 64, "model": 16})
    assert per_device * 1024 == nnxscale.full_bytes(shape, jnp.float32) == 4 << 40


# -------------------------------------------------------------------------------------
# errors
# -------------------------------------------------------------------------------------


def _layout_error(shape, spec, mesh, *fragments):
    with pytest.raises(ValueError) as info:
        nnxscale.shard_shape(shape, spec, mesh)
    assert isinstance(info.value, LayoutError)
    msg = str(info.value)
    for frag in fragments:
        if isinstance(frag, re.Pattern):
            assert frag.search(msg), f"{frag.pattern!r} not in {msg!r}"
        else:
            assert frag in msg, f"{frag!r} not in {msg!r}"


@pytest.mark.parametrize("as_dict", [False, True], ids=["Mesh", "dict"])
def test_errors_are_informative(as_dict):
    mesh = nnxscale.make_mesh("data=2,model=4")
    m = dict(mesh.shape) if as_dict else mesh
    # longer than the rank
    _layout_error((6,), P(None, None), m, "rank 1", "2 entries")
    _layout_error((), P("data"), m, "rank 0")
    # unknown axis: names it and the mesh's axes
    _layout_error((16,), P("fsdp"), m, "'fsdp'", "data", "model")
    _layout_error((16, 16), P(None, ("model", "tensor")), m, "'tensor'")
    # an axis used twice: names it and both dimensions
    _layout_error((16, 16), P("model", "model"), m, "'model'", "twice", re.compile(r"\b0\b"), re.compile(r"\b1\b"))
    _layout_error((16, 16), P(("data", "model"), "data"), m, "'data'", "twice")
    # indivisible: the dimension index, the sizes and the axes
    _layout_error((16, 6), P(None, "model"), m, "dimension 1", re.compile(r"\b6\b"), re.compile(r"\b4\b"), "model")
    _layout_error((12, 8), P(("data", "model")), m, "dimension 0", re.compile(r"\b12\b"),
                  re.compile(r"\b8\b"), "data", "model")


def test_layout_error_is_exported_value_error():
    assert issubclass(nnxscale.LayoutError, ValueError)


# -------------------------------------------------------------------------------------
# bytes, checked against arrays actually placed on devices
# -------------------------------------------------------------------------------------

PLACED = [
    ((64, 32), jnp.float32, P(None, "model")),
    ((64, 32), jnp.bfloat16, P("data", "model")),
    ((48,), jnp.float32, P()),
    ((16, 8, 4), np.int8, P("model", None, "data")),
    ((8, 24), jnp.float16, P(("data", "model"))),
    ((5, 3), jnp.int32, P(None, None)),
]


@pytest.mark.parametrize("mesh_spec", ["data=2,model=4", "data=4,model=2"])
def test_bytes_match_placed_arrays(mesh_spec):
    mesh = nnxscale.make_mesh(mesh_spec)
    arrays = []
    for shape, dtype, spec in PLACED:
        arr = jax.device_put(jnp.zeros(shape, dtype), NamedSharding(mesh, spec))
        arrays.append(arr)
        assert nnxscale.shard_bytes(shape, dtype, spec, mesh) == arr.addressable_shards[0].data.nbytes
        assert nnxscale.shard_bytes(shape, dtype, spec, dict(mesh.shape)) == arr.addressable_shards[0].data.nbytes
        assert nnxscale.full_bytes(shape, dtype) == arr.nbytes

    per_device_actual = {}
    for arr in arrays:
        for s in arr.addressable_shards:
            per_device_actual[s.device] = per_device_actual.get(s.device, 0) + s.data.nbytes
    assert len(per_device_actual) == 8
    per_device, full = nnxscale.state_bytes(PLACED, mesh)
    assert per_device == max(per_device_actual.values())
    assert full == sum(a.nbytes for a in arrays)
    assert nnxscale.state_bytes(PLACED, dict(mesh.shape)) == (per_device, full)
    assert nnxscale.state_bytes([], mesh) == (0, 0)
