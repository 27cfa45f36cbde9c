"""Collectives counted in compiled programs: by kind, per device, through loops."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import nnxscale
from nnxscale.planning import hlo as hlo


def _compiled_scan(layers: int):
    """grad of a scan over ``layers`` weights (256, 256) split over fsdp=8: one all-gather of
    each layer's weight in the forward loop and one in the backward loop."""
    mesh = nnxscale.make_mesh("fsdp=8")
    w = jax.ShapeDtypeStruct((layers, 256, 256), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp", None)))
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None)))

    def loss(w, x):
        h, _ = jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)
        return h.sum()

    out = NamedSharding(mesh, P(None, "fsdp", None))
    return jax.jit(jax.grad(loss), out_shardings=out).lower(w, x).compile()


@pytest.mark.parametrize("layers", [3, 6])
def test_collectives_inside_a_loop_count_once_per_trip(layers):
    ops = hlo.collectives(_compiled_scan(layers).as_text())
    gathers = [op for op in ops if op.kind == "all-gather"]
    assert gathers, ops
    full_weight = 256 * 256 * 4
    for op in gathers:  # a gathered weight is the whole (256, 256) layer, from 8 devices
        assert op.bytes == full_weight and op.group == 8 and op.executions == layers
    totals = hlo.collective_bytes(ops)
    assert totals["all-gather"] == sum(op.bytes * op.executions for op in gathers)
    assert totals["all-gather"] == len(gathers) * layers * full_weight
    assert set(totals) == set(hlo.KINDS)


def test_a_program_without_collectives():
    compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
    assert hlo.collectives(compiled.as_text()) == []
    assert sum(hlo.collective_bytes(compiled.as_text()).values()) == 0
    with pytest.raises(ValueError, match="ENTRY"):
        hlo.collectives("not hlo")


# The formats XLA:CPU does not print (GPU async pairs, reduce-scatter, explicit replica groups).
GPU_STYLE = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %p = (s32[], f32[1024]) parameter(0)
  %x = f32[1024]{0} get-tuple-element(%p), index=1
  %ags = (f32[256]{0}, f32[1024]{0}) all-gather-start(%x), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %agd = f32[1024]{0} all-gather-done(%ags)
  %rs = bf16[128]{0} reduce-scatter(%agd), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  ROOT %t = (s32[], f32[1024]) tuple(%i, %agd)
}

%cond (p: (s32[], f32[1024])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %ar = (f32[1024]{0}, bf16[16,8]{1,0}) all-reduce(%x, %y), replica_groups={{0,1}}, to_apply=%add
  %cp = (f32[512]{0}, f32[512]{0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1}}
  %w = (s32[], f32[1024]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = f32[1024]{0} get-tuple-element(%w), index=1
}
"""


def test_async_pairs_reduce_scatter_and_replica_group_formats():
    ops = {op.name: op for op in hlo.collectives(GPU_STYLE)}
    assert set(ops) == {"ags", "rs", "ar", "cp"}  # -done ops are not counted again
    assert (ops["ags"].bytes, ops["ags"].group, ops["ags"].executions) == (4096, 4, 5)  # the gathered result
    assert (ops["rs"].bytes, ops["rs"].group, ops["rs"].executions) == (128 * 2 * 4, 4, 5)  # the input: result x group
    assert (ops["ar"].bytes, ops["ar"].group) == (4096 + 16 * 8 * 2, 2)  # a tuple all-reduce: every buffer
    assert (ops["cp"].kind, ops["cp"].bytes) == ("collective-permute", 2048)
    totals = hlo.collective_bytes(GPU_STYLE)
    assert totals["all-gather"] == 5 * 4096 and totals["reduce-scatter"] == 5 * 1024
    # ring algorithms: gathers and scatters send (n-1)/n, an all-reduce twice that
    wire = hlo.wire_bytes(hlo.collectives(GPU_STYLE))
    assert wire == int(5 * 4096 * 3 / 4 + 5 * 1024 * 3 / 4 + (4096 + 256) * 2 * 1 / 2 + 2048)


def test_mesh_replica_groups_with_a_device_order():
    """A manual shard_map's all-reduce names its mesh axes after a device order."""
    text = """HloModule m

ENTRY %main (x: f32[256]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  ROOT %ar = f32[256]{0} all-reduce(%x), channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, use_global_device_ids=true, to_apply=%add
}
"""
    (op,) = hlo.collectives(text)
    assert (op.kind, op.bytes, op.group) == ("all-reduce", 1024, 4)
