"""Collectives counted in compiled programs: by kind, per device, through loops."""

import functools
import gzip
import math
import sys
from pathlib import Path

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
    # the members: devices in the order [0, 4, 1, 5, 2, 6, 3, 7] laid out 4 x 2, grouped along axis_0
    attrs = "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
    assert hlo.group_members(attrs, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hlo.group_members(attrs.replace("([2,4]T(1,0))", "[8]<=[2,4]T(1,0)"), 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hlo.group_members(attrs.replace("{'axis_0'}", "{'axis_1'}"), 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]

# --------------------------------------------------------------------------------------
# Real compilers' programs: tests/data/hlo/*.hlo.gz (tests/data/hlo/make_fixtures.py).
# Each hand-written step's collectives follow from its shapes and mesh (STEPS); the
# counter must find exactly those, in the dtype each compiler chose, on every backend.
# --------------------------------------------------------------------------------------

FIXTURES = Path(__file__).parent / "data" / "hlo"
sys.path.insert(0, str(FIXTURES))
from make_fixtures import BACKENDS, NNXSCALE_STEPS, STEPS, count_by_results  # noqa: E402

sys.path.remove(str(FIXTURES))


@functools.cache
def fixture_ops(backend: str, step: str) -> tuple[hlo.Collective, ...]:
    with gzip.open(FIXTURES / f"{backend}_{step}.hlo.gz", "rt") as f:
        return tuple(hlo.collectives(f.read()))


def elements(op: hlo.Collective) -> int:
    """Elements per execution of the tensors an op counts (bytes without the dtype)."""
    return sum(math.prod(s) for s in op.shapes)


def moved(ops, kinds, each: int, group: int | None = None) -> int:
    """Elements moved per run by the ops of ``kinds`` that move ``each`` elements at a time."""
    picked = [op for op in ops if op.kind in kinds and elements(op) == each]
    assert all(group is None or op.group == group for op in picked), [(op.name, op.group) for op in picked]
    return sum(elements(op) * op.executions for op in picked)


ITEMSIZE = {"f32": 4, "bf16": 2}
#: XLA:CPU has no reduce-scatter: it all-reduces the gradient and each device keeps its part.
GRADIENT_REDUCTION = ("reduce-scatter", "all-reduce")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step", list(STEPS))
def test_every_op_counts_its_tensors_in_the_dtype_compiled(backend, step):
    ops = fixture_ops(backend, step)
    assert ops and all(op.trips_known and not op.in_branch for op in ops)
    for op in ops:
        assert op.dtype in ITEMSIZE, op
        assert op.bytes == elements(op) * ITEMSIZE[op.dtype], op


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp_gathers_each_weight_twice_and_reduces_its_gradient_once(backend):
    c = STEPS["fsdp_scan"]
    ops, n, layer = fixture_ops(backend, "fsdp_scan"), c["mesh"]["fsdp"], c["width"] ** 2
    assert moved(ops, ("all-gather",), layer, n) == 2 * c["layers"] * layer  # forward, and backward (remat)
    assert moved(ops, GRADIENT_REDUCTION, layer, n) == c["layers"] * layer
    if backend != "cpu":  # the step computes in bfloat16: the accelerators gather and reduce in it
        assert {op.dtype for op in ops if op.kind in ("all-gather", "reduce-scatter")} == {"bf16"}
        assert moved(ops, ("reduce-scatter",), layer, n) == c["layers"] * layer


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_accumulation_nests_the_layer_loop_in_the_microbatch_loop(backend):
    c = STEPS["fsdp_accum"]
    ops, n, layer = fixture_ops(backend, "fsdp_accum"), c["mesh"]["fsdp"], c["width"] ** 2
    assert moved(ops, ("all-gather",), layer, n) == c["micro"] * 2 * c["layers"] * layer
    assert moved(ops, GRADIENT_REDUCTION, layer, n) == c["micro"] * c["layers"] * layer
    loops = {op.executions for op in ops if op.kind == "all-gather" and elements(op) == layer}
    assert loops == {c["micro"] * c["layers"]}  # inner trip count x outer trip count


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_all_reduces_activations_over_model_and_gradients_over_data(backend):
    c = STEPS["tp_mlp"]
    ops, (data, model) = fixture_ops(backend, "tp_mlp"), (c["mesh"]["data"], c["mesh"]["model"])
    activation = c["batch"] // data * c["width"]
    weight = c["width"] * c["hidden"] // model  # each of the two weights' shards
    assert moved(ops, ("all-reduce",), activation, model) == 2 * c["layers"] * activation  # forward and backward
    gradients = [op for op in ops if op.kind == "all-reduce" and op.group == data]
    assert sum(elements(op) * op.executions for op in gradients) == c["layers"] * 2 * weight
    assert hlo.collective_bytes(ops)["all-reduce"] == sum(op.total_bytes for op in ops)  # nothing else


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_context_ring_permutes_keys_and_values_once_per_hop(backend):
    c = STEPS["context_ring"]
    ops, n = fixture_ops(backend, "context_ring"), c["mesh"]["context"]
    block = c["batch"] * c["seq"] // n * c["heads"] * c["head_dim"]
    assert {op.kind for op in ops} == {"collective-permute"}
    assert sum(elements(op) * op.executions for op in ops) == n * 2 * block  # n hops of K and V
    assert all(op.executions == n for op in ops)


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_exchange_tokens_twice_forward_and_twice_backward(backend):
    c = STEPS["expert_a2a"]
    ops, n = fixture_ops(backend, "expert_a2a"), c["mesh"]["expert"]
    assert {op.kind for op in ops} == {"all-to-all"}
    assert moved(ops, ("all-to-all",), c["tokens"] // n * c["width"], n) == 4 * c["tokens"] // n * c["width"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step", [*STEPS, *NNXSCALE_STEPS])
def test_the_count_agrees_with_an_op_by_op_count_of_the_results(backend, step):
    with gzip.open(FIXTURES / f"{backend}_{step}.hlo.gz", "rt") as f:
        text = f.read()
    assert hlo.collective_bytes(text) == count_by_results(text)


# Forms the fixtures do not show: an async-start wrapping a computation, a conditional, a loop
# whose trip count cannot be read, TPU loops (no recorded count) from 2 to 7 and from 0 to 3 (a
# fused condition, written bound > counter).
WRAPPED = """HloModule m, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_reduce_scatter (p: f32[64]) -> f32[16] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(%p), replica_groups={}, dimensions={0}, to_apply=%add
}

%gather (p: f32[16]) -> f32[64] {
  %p = f32[16]{0} parameter(0)
  ROOT %ag = f32[64]{0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}
}

%reduce (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  %ar = f32[64]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %ar2 = f32[64]{0} all-reduce(%ar), replica_groups={{0,1,2,3}}, to_apply=%add
}

%cond (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %x = f32[64]{0} get-tuple-element(%p), index=1
  %y = f32[64]{0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %t = (s32[], f32[64]) tuple(%next, %y)
}

%fused_lt (c: s32[]) -> pred[] {
  %c = s32[] parameter(0)
  %limit = s32[] constant(3)
  ROOT %gt = pred[] compare(%limit, %c), direction=GT
}

%fused_cond (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %f = pred[] fusion(%i), kind=kLoop, calls=%fused_lt
}

%opaque_cond (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]) parameter(0)
  ROOT %go = pred[] custom-call(%p), custom_call_target="keep_going"
}

ENTRY %main (x: f32[64], c: pred[]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  %c = pred[] parameter(1)
  %start = ((f32[64]{0}), f32[16]{0}, u32[]) async-start(%x), calls=%wrapped_reduce_scatter
  %done = f32[16]{0} async-done(%start), calls=%wrapped_reduce_scatter
  %branch = f32[64]{0} conditional(%c, %done, %x), branch_computations={%gather, %reduce}
  %two = s32[] constant(2)
  %counter = s32[] copy(%two)
  %init = (s32[], f32[64]) tuple(%counter, %branch)
  %loop = (s32[], f32[64]) while(%init), condition=%cond, body=%body
  %unknown = (s32[], f32[64]) while(%init), condition=%opaque_cond, body=%body
  %zero = s32[] constant(0)
  %init0 = (s32[], f32[64]) tuple(%zero, %x)
  %fused = (s32[], f32[64]) while(%init0), condition=%fused_cond, body=%body
  ROOT %r = f32[64]{0} get-tuple-element(%loop), index=1
}
"""


def test_wrapped_async_ops_conditionals_and_loops_without_a_recorded_count():
    ops = {(op.computation, op.name): op for op in hlo.collectives(WRAPPED)}
    rs = ops["wrapped_reduce_scatter", "rs"]  # once, though the start and the done both name it
    assert (rs.kind, rs.bytes, rs.group, rs.executions) == ("reduce-scatter", 64 * 4, 4, 1)  # no groups: every device
    ag, ar = ops["gather", "ag"], ops["reduce", "ar"]  # one branch runs: the heavier one is counted
    assert ag.in_branch and ar.in_branch and (ag.executions, ar.executions, ops["reduce", "ar2"].executions) == (0, 1, 1)
    loop = ops["body", "y"]  # 7 - 2 and 3 - 0 trips read from the loops, and 1 for the loop it cannot read
    assert loop.executions == 5 + 3 + 1 and not loop.trips_known
    assert hlo.collective_bytes(WRAPPED)["all-reduce"] == 9 * 256 + 2 * 256
    assert hlo.collective_bytes(WRAPPED)["all-gather"] == 0



def test_a_collective_whose_type_cannot_be_read_is_named():
    text = """HloModule m

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %odd = f32[?] custom-call(%x), custom_call_target="x"
  ROOT %ag = f32[?,8]{1,0} all-gather(%x), replica_groups={{0,1}}, dimensions={0}
}
"""
    with pytest.raises(ValueError, match="cannot read the collective %ag in computation %main"):
        hlo.collectives(text)
    assert hlo.collectives(text.replace("f32[?,8]", "f32[16]")) != []  # the other unreadable op is no collective


# --------------------------------------------------------------------------------------
# FLOPs: matrix products counted through loops, the same on every backend's HLO
# --------------------------------------------------------------------------------------


def step_flops(step: str) -> float:
    """Matmul FLOPs per device of one run of a hand-written step, from its shapes (STEPS):
    2 per multiply-add; a step's gradient runs each product forward once and twice backward,
    a rematerialized layer its forward once more."""
    c = STEPS[step]
    n = math.prod(c["mesh"].values())
    if step in ("fsdp_scan", "fsdp_accum"):  # (batch / n, width) @ (width, width) per layer, remat: 4 products
        return c.get("micro", 1) * c["layers"] * 4 * 2 * (c["batch"] // n) * c["width"] ** 2
    if step == "tp_mlp":  # two products per layer on (batch / data) rows, hidden / model columns; no remat: 3x
        rows, cols = c["batch"] // c["mesh"]["data"], c["hidden"] // c["mesh"]["model"]
        return c["layers"] * 3 * 2 * 2 * rows * c["width"] * cols
    if step == "context_ring":  # per hop: k.v (b k h d e) then q.(kv) (b q h d e), forward only
        b, s, h, d = c["batch"], c["seq"] // n, c["heads"], c["head_dim"]
        return n * 2 * 2 * b * s * h * d * d
    if step == "expert_a2a":  # each device's expert sees tokens / n rows: two products, 3x for the gradient
        return 3 * 2 * 2 * (c["tokens"] // n) * c["width"] * c["hidden"]
    raise KeyError(step)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("step", list(STEPS))
def test_matmul_flops_count_each_loop_trip_on_every_backend(backend, step):
    with gzip.open(FIXTURES / f"{backend}_{step}.hlo.gz", "rt") as f:
        ops = hlo.matmuls(f.read())
    assert ops and all(op.trips_known and op.flops > 0 for op in ops)
    assert hlo.matmul_flops(ops) == step_flops(step)  # XLA:TPU's batched-matmul convolutions included


def test_the_nnxscale_step_counts_the_same_flops_on_every_backend():
    counts = {}
    for backend in BACKENDS:
        with gzip.open(FIXTURES / f"{backend}_llama_fsdp.hlo.gz", "rt") as f:
            counts[backend] = hlo.matmul_flops(f.read())
    assert len(set(counts.values())) == 1, counts
    # llama-tiny, remat full, 16 x 128 tokens on 8 devices, 2 micro-batches: the formula plus
    # each layer's forward again, less the MLP's down projection XLA does not recompute.
    from nnxscale.models.llama.config import PRESETS

    c, spec = PRESETS["llama-tiny"], NNXSCALE_STEPS["llama_fsdp"]
    tokens = spec["batch_size"] * spec["seq_len"] / 8
    formula = c.flops_per_token(spec["seq_len"]) * tokens
    again = (c.flops_per_token(spec["seq_len"]) - 6 * c.vocab_size * c.hidden_size) / 3 * tokens
    down = 2 * c.hidden_size * c.intermediate_size * c.num_hidden_layers * tokens
    assert abs(counts["cpu"] / (formula + again - down) - 1) < 0.005


def test_a_convolution_counts_only_the_taps_that_meet_the_input():
    """XLA:TPU writes a batched matmul as a convolution whose batch dimension is a window over
    an input dilated by as much, or as a window sliding over a length-1 input's padding
    (both forms taken from its programs): one tap per output position meets the input."""
    text = """HloModule m, num_partitions=1

ENTRY %main (a: bf16[128,64,2], b: bf16[64,32,2], c: bf16[128,128,1], d: bf16[16,8,128]) -> (f32[2,128,32], bf16[128,16,8]) {
  %a = bf16[128,64,2]{2,1,0} parameter(0)
  %b = bf16[64,32,2]{2,1,0} parameter(1)
  %c = bf16[128,128,1]{2,1,0} parameter(2)
  %d = bf16[16,8,128]{2,1,0} parameter(3)
  %dilated = f32[2,128,32]{2,1,0} convolution(%a, %b), window={size=2 stride=1 lhs_dilate=2}, dim_labels=bf0_io0->0bf
  %padded = bf16[128,16,8]{2,1,0} convolution(%c, %d), window={size=16 pad=15_15 rhs_reversal=1}, dim_labels=bf0_0oi->b0f
  ROOT %t = (f32[2,128,32]{2,1,0}, bf16[128,16,8]{2,1,0}) tuple(%dilated, %padded)
}
"""
    ops = {op.name: op for op in hlo.matmuls(text)}
    assert ops["dilated"].flops == 2 * 2 * 128 * 64 * 32  # two (128, 64) @ (64, 32) products
    assert ops["padded"].flops == 2 * 16 * 128 * 128 * 8  # sixteen (128, 128) @ (128, 8) products
