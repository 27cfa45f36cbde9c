"""make_mesh: shapes, axis names and types from a short spec, and errors that say what is wrong."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import nnxscale
from nnxscale.sharding.mesh import MeshError, parse_mesh_spec


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("data=4,model=2", {"data": 4, "model": 2}),
        ("fsdp=-1", {"fsdp": 8}),
        ("data=2,fsdp=2,tensor=2", {"data": 2, "fsdp": 2, "tensor": 2}),
        ("data=2,model=-1", {"data": 2, "model": 4}),
        ("model=8", {"model": 8}),
        ({"data": 4, "model": 2}, {"data": 4, "model": 2}),
        ({"data": -1, "model": 4}, {"data": 2, "model": 4}),
        ("  data = 4 ,  model=2 ", {"data": 4, "model": 2}),
        ("\tdata=2,\n fsdp = 4\n", {"data": 2, "fsdp": 4}),
    ],
)
def test_make_mesh_shape_names_and_auto_axes(spec, expected):
    mesh = nnxscale.make_mesh(spec)
    assert isinstance(mesh, Mesh)
    assert mesh.axis_names == tuple(expected)  # the order written
    assert dict(mesh.shape) == expected
    assert mesh.devices.shape == tuple(expected.values())
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert len(mesh.axis_types) == len(expected)
    # every device exactly once
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_make_mesh_on_given_devices():
    one = nnxscale.make_mesh("data=1", devices=jax.devices()[:1])
    assert dict(one.shape) == {"data": 1}
    assert list(one.devices.flat) == jax.devices()[:1]

    four = nnxscale.make_mesh("data=-1,model=2", devices=jax.devices()[4:])
    assert dict(four.shape) == {"data": 2, "model": 2}
    assert {d.id for d in four.devices.flat} == {d.id for d in jax.devices()[4:]}

    # the product is checked against the devices given, not all devices
    with pytest.raises(MeshError, match=r"\b4\b"):
        nnxscale.make_mesh("data=8", devices=jax.devices()[:4])


def test_mesh_is_usable_for_sharding():
    mesh = nnxscale.make_mesh("data=2,model=4")
    x = jax.device_put(np.arange(32.0).reshape(4, 8), jax.NamedSharding(mesh, jax.P("data", "model")))
    assert {s.data.shape for s in x.addressable_shards} == {(2, 2)}
    np.testing.assert_array_equal(np.asarray(x), np.arange(32.0).reshape(4, 8))


def test_parse_mesh_spec_keeps_order_and_wildcard():
    assert list(parse_mesh_spec("model=2,data=-1").items()) == [("model", 2), ("data", -1)]


def test_mesh_error_is_a_value_error():
    assert issubclass(MeshError, ValueError)
    assert nnxscale.MeshError is MeshError


def _raises(spec, *fragments, devices=None):
    with pytest.raises(MeshError) as info:
        nnxscale.make_mesh(spec, devices=devices)
    msg = str(info.value)
    for frag in fragments:
        if isinstance(frag, re.Pattern):
            assert frag.search(msg), f"{frag.pattern!r} not in {msg!r}"
        else:
            assert frag in msg, f"{frag!r} not in {msg!r}"
    return msg


def test_error_product_does_not_match_device_count():
    _raises("data=3", re.compile(r"\b3\b"), re.compile(r"\b8\b"))
    _raises("data=2,model=2", re.compile(r"\b4\b"), re.compile(r"\b8\b"))
    _raises({"data": 4, "model": 4}, re.compile(r"\b16\b"), re.compile(r"\b8\b"))


def test_error_more_than_one_wildcard():
    _raises("data=-1,model=-1", "-1", "data", "model")


@pytest.mark.parametrize("spec, name, size", [("data=0,model=8", "data", "0"), ("data=8,model=0", "model", "0"),
                                              ("data=-2,model=-4", "data", "-2"), ({"fsdp": -8}, "fsdp", "-8")])
def test_error_zero_and_negative_sizes(spec, name, size):
    _raises(spec, repr(name), re.compile(rf"(?<![\w-]){re.escape(size)}\b"))


def test_error_duplicate_axis_names():
    _raises("data=2,data=4", "'data'", "twice")


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("data", "'data'"),
        ("data=x", "'x'"),
        ("=4", "''"),
        ("da ta=2", "'da ta'"),
        ("data=2=2", "'data=2=2'"),
        ("data=8,", "''"),
        ("data=2.5,model=4", "'2.5'"),
        ({"data": 8.0}, "8.0"),
        ({"da-ta": 8}, "'da-ta'"),
    ],
)
def test_error_malformed_entries_name_the_entry(spec, fragment):
    _raises(spec, fragment)


def test_error_empty_spec_and_wrong_type():
    _raises("", "data=4")
    _raises("   ")
    _raises(8, "int")


def test_error_wildcard_cannot_divide():
    msg = _raises("data=3,fsdp=-1", "fsdp", re.compile(r"\b3\b"), re.compile(r"\b8\b"))
    assert "-1" in msg
    _raises("data=16,model=-1", "model", re.compile(r"\b16\b"), re.compile(r"\b8\b"))
