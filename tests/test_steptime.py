"""The step-time prediction (planning.steptime): a walk over compiled, scheduled programs.

Pure arithmetic over HLO text: the saved compiles of tests/data/hlo (XLA:CPU, the H100
compiler, the TPU v5e compiler) and small modules written here, where every figure follows
by hand from the shapes and a made-up chip's round numbers."""

import dataclasses
import gzip
import json
import math
import re
from pathlib import Path

import pytest

from nnxscale.planning import hlo, steptime, targets
from nnxscale.planning.hardware import CHIPS, Hardware, Link
from nnxscale.planning.steptime import Placement, predict

FIXTURES = Path(__file__).parent / "data" / "hlo"

#: A chip of round numbers: 1 PFLOP/s bf16, 1 TB/s HBM, 100 GB/s inside a node, 10 GB/s between.
CHIP = Hardware(
    name="test chip", peak_flops={"bfloat16": 1e15, "float32": 5e14}, hbm_bandwidth=1e12,
    links={"nvlink": Link("nvlink", 1e11, 0.0, 1.0), "network": Link("network", 1e10, 0.0, 1.0)},
    matmul_efficiency=1.0, memory_efficiency=1.0, op_overhead=0.0,
)  # fmt: skip


def _predict(text, hw=CHIP, **kw):
    return predict(text, hw, n_devices=8, tokens_per_step=1024, model_flops_per_step=0.0, **kw)


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.hlo.gz") if "llama" not in p.name))
def test_the_walk_finds_every_collective_and_matmul_the_counters_find(name):
    text = gzip.open(FIXTURES / name, "rt").read()
    st = _predict(text, CHIPS["v5e"] if name.startswith("tpu") else CHIPS["h100"])
    by_kind = {k: sum(c.bytes for c in st.collectives if c.kind == k) for k in hlo.KINDS}
    assert by_kind == pytest.approx(hlo.collective_bytes(text))
    assert sum(c.count for c in st.collectives) == sum(op.executions for op in hlo.collectives(text))
    assert st.flops == pytest.approx(hlo.matmul_flops(text))
    # the parts add up to the step; what is hidden is no more than what the links take
    assert st.seconds == pytest.approx(st.compute_s + st.memory_s + st.overhead_s + st.exposed_collective_s)
    assert 0 <= st.exposed_collective_s <= st.collective_s + 1e-12
    for c in st.collectives:  # a wait behind a queue of collectives is theirs, not the waiting one's
        assert -1e-12 <= c.exposed <= c.seconds + 1e-12, c
    assert st.tokens_per_s == pytest.approx(1024 / st.seconds) and st.bottleneck


def test_a_real_training_step_on_each_compiler():
    """llama-tiny's whole step (fsdp=8) as the H100's and the TPU's compilers scheduled it."""
    for backend, chip in (("h100", "h100"), ("tpu", "v5e")):
        text = gzip.open(FIXTURES / f"{backend}_llama_fsdp.hlo.gz", "rt").read()
        st = _predict(text, CHIPS[chip])
        assert st.flops == pytest.approx(hlo.matmul_flops(text))
        assert sum(c.bytes for c in st.collectives) == pytest.approx(sum(hlo.collective_bytes(text).values()))
        assert st.exposed_collective_s < st.collective_s  # their schedulers start collectives early: some time is hidden
    assert json.loads(json.dumps(st.to_json()))["collectives"][0]["kind"] in hlo.KINDS


# Written by hand: a gather of a (4096, 4096) bf16 weight from 8 devices beside a matmul of two such.
OVERLAP = """HloModule overlap, is_scheduled=true, num_partitions=8

%fused_dot (p0: bf16[4096,4096], p1: bf16[4096,4096]) -> bf16[4096,4096] {
  %p0 = bf16[4096,4096]{1,0} parameter(0)
  %p1 = bf16[4096,4096]{1,0} parameter(1)
  ROOT %dot = bf16[4096,4096]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[512,4096], x: bf16[4096,4096], y: bf16[4096,4096]) -> bf16[4096,4096] {
  %a = bf16[512,4096]{1,0} parameter(0)
  %x = bf16[4096,4096]{1,0} parameter(1)
  %y = bf16[4096,4096]{1,0} parameter(2)
  %ag-start = (bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}) all-gather-start(%a), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %f = bf16[4096,4096]{1,0} fusion(%x, %y), kind=kCustom, calls=%fused_dot
  %ag-done = bf16[4096,4096]{1,0} all-gather-done(%ag-start)
  ROOT %out = bf16[4096,4096]{1,0} add(%f, %ag-done)
}
"""
MATRIX = 4096 * 4096 * 2  # bytes of one bf16 (4096, 4096)


def test_one_ops_time_is_its_roofline_by_hand():
    st = _predict(OVERLAP)
    matmul = 2 * 4096**3 / 1e15  # FLOPs over the peak: compute-bound (memory: 3 matrices / 1 TB/s is less)
    assert 3 * MATRIX / 1e12 < matmul
    add = 3 * MATRIX / 1e12  # two read, one written: memory-bound
    assert st.compute_s == pytest.approx(matmul) and st.memory_s == pytest.approx(add)
    assert st.flops == 2 * 4096**3 and st.hbm_bytes == pytest.approx(6 * MATRIX)
    slow = dataclasses.replace(CHIP, matmul_efficiency=0.5, op_overhead=1e-6)
    st2 = _predict(OVERLAP, slow)
    assert st2.compute_s == pytest.approx(2 * matmul) and st2.overhead_s == pytest.approx(2e-6)


def test_the_bottleneck_line_gives_rates_in_their_own_units():
    """An accelerator's bandwidth in TB/s, an XLA:CPU device's in GB/s (it read 0.00 TB/s)."""
    from nnxscale.planning.steptime import bottleneck, format_si

    assert (format_si(3.02e12, "B/s"), format_si(4.1e9, "B/s"), format_si(850e6, "B/s")) == ("3.02 TB/s", "4.1 GB/s", "850 MB/s")
    assert (format_si(1234e12, "FLOP"), format_si(8.6e9, "FLOP")) == ("1,234 TFLOP", "8.6 GFLOP")
    st = _predict(OVERLAP)
    memory = dataclasses.replace(st, memory_s=10 * st.seconds)
    for bandwidth, shown in ((1e12, "1 TB/s"), (2.5e9, "2.5 GB/s")):
        chip = dataclasses.replace(CHIP, hbm_bandwidth=bandwidth, memory_efficiency=1.0)
        line = bottleneck(memory, chip)
        assert line.startswith("memory-bound") and f"({shown} effective)" in line, line
    compute = dataclasses.replace(st, compute_s=10 * st.seconds)
    assert "(137 GFLOP per device;" in bottleneck(compute, CHIP), bottleneck(compute, CHIP)


def test_an_async_collective_hides_behind_the_compute_scheduled_inside_it():
    st = _predict(OVERLAP)
    gather = 7 / 8 * MATRIX / 1e11  # (n-1)/n of the gathered tensor over 100 GB/s
    matmul = 2 * 4096**3 / 1e15
    (c,) = st.collectives
    assert (c.kind, c.link, c.count) == ("all-gather", "nvlink", 1) and c.bytes == MATRIX
    assert c.seconds == pytest.approx(gather)
    assert c.exposed == pytest.approx(gather - matmul)  # the matmul between start and done hides its share
    assert st.seconds == pytest.approx(matmul + (gather - matmul) + 3 * MATRIX / 1e12)
    # Synchronous, the same gather is all exposed; a faster link hides it entirely.
    sync = OVERLAP.replace("(bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}) all-gather-start(", "bf16[4096,4096]{1,0} all-gather(")
    sync = sync.replace("  %ag-done = bf16[4096,4096]{1,0} all-gather-done(%ag-start)\n", "").replace("%ag-done", "%ag-start")
    assert _predict(sync).exposed_collective_s == pytest.approx(gather)
    fast = dataclasses.replace(CHIP, links={"nvlink": Link("nvlink", 1e13, 0.0, 1.0)})
    assert _predict(OVERLAP, fast).exposed_collective_s == 0


def test_a_loop_body_counts_once_per_trip():
    text = gzip.open(FIXTURES / "h100_fsdp_scan.hlo.gz", "rt").read()  # a scan over 4 layers, forward and backward
    st = _predict(text)
    trips = {op.executions for op in hlo.collectives(text) if op.kind == "all-gather"}
    assert trips == {4}
    gathers = [c for c in st.collectives if c.kind == "all-gather"]
    assert sum(c.count for c in gathers) == sum(op.executions for op in hlo.collectives(text) if op.kind == "all-gather")


def test_a_group_across_nodes_runs_hierarchically():
    """16 devices on 2 nodes of 8: a gather over all 16 is bound by each node's 8 NICs
    (the slower of 7/8 of the bytes over NVLink and 1/2 over 8 x 10 GB/s); a gather over
    the 2 devices of a pair on different nodes by one NIC."""
    text = OVERLAP.replace("num_partitions=8", "num_partitions=16")
    where = Placement("nvlink", "network", tuple([0] * 8 + [1] * 8))
    wide = text.replace("replica_groups={{0,1,2,3,4,5,6,7}}", "replica_groups=[1,16]<=[16]")
    (c,) = _predict(wide, placement=where).collectives
    assert c.link == "network" and c.seconds == pytest.approx(max(7 / 8 * MATRIX / 1e11, 1 / 2 * MATRIX / (8 * 1e10)))
    pairs = text.replace("replica_groups={{0,1,2,3,4,5,6,7}}", "replica_groups=[8,2]<=[2,8]T(1,0)")
    (c,) = _predict(pairs, placement=where).collectives
    assert c.link == "network" and c.seconds == pytest.approx(1 / 2 * MATRIX / 1e10)
    inside = text.replace("replica_groups={{0,1,2,3,4,5,6,7}}", "replica_groups=[2,8]<=[16]")
    (c,) = _predict(inside, placement=where).collectives
    assert c.link == "nvlink" and c.seconds == pytest.approx(7 / 8 * MATRIX / 1e11)
    # Without a placement, the mesh axes say it: data=2 across the nodes, fsdp=8 inside.
    (c,) = _predict(pairs, axis_links={"data": "network", "fsdp": "nvlink"}, mesh={"data": 2, "fsdp": 8}).collectives
    assert c.link == "network"
    (c,) = _predict(inside, axis_links={"data": "network", "fsdp": "nvlink"}, mesh={"data": 2, "fsdp": 8}).collectives
    assert c.link == "nvlink"


def test_each_collective_is_named_by_the_mesh_axes_its_groups_span():
    """The groups [8,2]<=[2,8]T(1,0) pair device i with i + 8: on mesh data=2,fsdp=8 (device =
    8 x data + fsdp) they differ in data only; [2,8]<=[16] in fsdp only; one group of 16 in
    both. The bottleneck line names them; a mesh the groups do not fit names none."""
    text = OVERLAP.replace("num_partitions=8", "num_partitions=16")
    mesh = {"data": 2, "fsdp": 8}
    slow = dataclasses.replace(CHIP, links={"network": Link("network", 1e9, 0.0, 1.0)})  # the gather exposes most of the step
    for groups, axes in (("[8,2]<=[2,8]T(1,0)", "data"), ("[2,8]<=[16]", "fsdp"), ("[1,16]<=[16]", "data,fsdp")):
        st = _predict(text.replace("{{0,1,2,3,4,5,6,7}}", groups), slow, mesh=mesh)
        (c,) = st.collectives
        assert c.axes == axes and steptime.worst_collective(st) is c
        assert st.bottleneck.startswith(f"communication-bound: ") and f"the {axes} all-gathers cross network at 1 GB/s" in st.bottleneck
        line = next(x for x in steptime.format_lines(st) if "all-gather" in x and "bottleneck" not in x)
        assert line.lstrip().startswith(f"all-gather over network ({axes})")
    (c,) = _predict(text.replace("{{0,1,2,3,4,5,6,7}}", "[2,8]<=[16]"), slow, mesh={"fsdp": 8}).collectives  # 8 devices, 16 in the groups
    assert c.axes == ""
    (c,) = _predict(OVERLAP).collectives  # no mesh given
    assert c.axes == ""


def test_a_torus_ring_uses_both_directions_where_it_wraps():
    torus = Placement("ici", "dcn", (0,) * 8, tuple((x, y) for y in range(2) for x in range(4)), (4, 2), (True, False))
    assert torus.ways([0, 1, 2, 3]) == 2  # along x: all 4, wrapped
    assert torus.ways([0, 4]) == 1  # along y: no wraparound
    assert torus.ways(range(8)) == 3 and torus.ways([0, 1]) == 1  # both dimensions; part of x
    assert Placement.from_json(torus.to_json()) == torus


def test_every_target_has_figures_with_sources():
    for t in targets.catalog():
        hw = steptime.hardware_for(t)
        assert hw is steptime.hardware_for(t.name) is CHIPS[t.chip]
        assert hw.peak("bfloat16") > 0 and hw.hbm_bandwidth > 0 and hw.sources
        assert 0 < hw.matmul_efficiency <= 1 and 0 < hw.memory_efficiency <= 1
        for link in hw.links.values():
            assert link.bandwidth > 0 and 0 < link.efficiency <= 1 and link.sources
        inside, between = ("nvlink", "network") if t.family == "gpu" else ("ici", "dcn")
        assert {inside, between} <= set(hw.links)
    # a hardware figure shared with the targets' data is that data, not a copy
    assert CHIPS["h100"].hbm_bandwidth == targets.GPU_CHIPS["h100"]["memory_bandwidth"]
    assert steptime.axis_links_for({"data": 2, "model": 8}, targets.get("h100x16")) == {"data": "network", "model": "nvlink"}


def test_cpu_figures_come_from_registration(monkeypatch):
    monkeypatch.setattr(steptime, "_REGISTERED", {})
    with pytest.raises(KeyError, match="register_hardware"):
        steptime.hardware_for("cpu")
    steptime.register_hardware("cpu", CHIP)
    assert steptime.hardware_for("cpu") is CHIP
    with pytest.raises(TypeError):
        steptime.register_hardware("cpu", {"peak": 1})
    with pytest.raises(ValueError, match="link 'ib'"):
        _predict(OVERLAP, axis_links={"fsdp": "ib"})


def test_mfu_and_throughput():
    st = predict(OVERLAP, CHIP, n_devices=8, tokens_per_step=4096, model_flops_per_step=8 * 1e12)
    assert st.tokens_per_s_per_device == pytest.approx(4096 / st.seconds / 8)
    assert st.mfu == pytest.approx(8e12 / (8 * 1e15 * st.seconds))
    assert math.isclose(predict(OVERLAP, CHIP, n_devices=8, tokens_per_step=1, model_flops_per_step=8e12,
                                compute_dtype="float32").mfu, 2 * st.mfu)  # fmt: skip


# A loop whose body waits, after its first matmul, for the gather its previous turn started
# after that matmul (a pipelined collective: started before the loop for the first turn).
PIPELINED = """HloModule pipelined, is_scheduled=true, num_partitions=8

%fused_dot (p0: bf16[4096,4096], p1: bf16[4096,4096]) -> bf16[4096,4096] {
  %p0 = bf16[4096,4096]{1,0} parameter(0)
  %p1 = bf16[4096,4096]{1,0} parameter(1)
  ROOT %dot = bf16[4096,4096]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], bf16[512,4096], (bf16[512,4096], bf16[4096,4096]), bf16[4096,4096])) -> (s32[], bf16[512,4096], (bf16[512,4096], bf16[4096,4096]), bf16[4096,4096]) {
  %p = (s32[], bf16[512,4096]{1,0}, (bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}), bf16[4096,4096]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %a = bf16[512,4096]{1,0} get-tuple-element(%p), index=1
  %prev = (bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}) get-tuple-element(%p), index=2
  %w = bf16[4096,4096]{1,0} get-tuple-element(%p), index=3
  %f = bf16[4096,4096]{1,0} fusion(%w, %w), kind=kCustom, calls=%fused_dot
  %done = bf16[4096,4096]{1,0} all-gather-done(%prev)
  %start = (bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}) all-gather-start(%a), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %g = bf16[4096,4096]{1,0} fusion(%f, %done), kind=kCustom, calls=%fused_dot
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[512,4096]{1,0}, (bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}), bf16[4096,4096]{1,0}) tuple(%next, %a, %start, %g)
}

%cond (p: (s32[], bf16[512,4096], (bf16[512,4096], bf16[4096,4096]), bf16[4096,4096])) -> pred[] {
  %p = (s32[], bf16[512,4096]{1,0}, (bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}), bf16[4096,4096]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: bf16[512,4096], w: bf16[4096,4096]) -> bf16[4096,4096] {
  %a = bf16[512,4096]{1,0} parameter(0)
  %w = bf16[4096,4096]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %start0 = (bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}) all-gather-start(%a), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %init = (s32[], bf16[512,4096]{1,0}, (bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}), bf16[4096,4096]{1,0}) tuple(%zero, %a, %start0, %w)
  %loop = (s32[], bf16[512,4096]{1,0}, (bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}), bf16[4096,4096]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %last = (bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}) get-tuple-element(%loop), index=2
  ROOT %out = bf16[4096,4096]{1,0} all-gather-done(%last)
}
"""


def test_a_collective_a_loop_turn_starts_for_the_next_hides_behind_both_turns():
    st = _predict(PIPELINED)
    gather = 7 / 8 * MATRIX / 1e11
    matmul = 2 * 4096**3 / 1e15
    (c,) = st.collectives
    assert c.count == 5 and c.seconds == pytest.approx(5 * gather)  # 4 turns and the one before the loop
    # each turn's gather runs behind its second matmul and the next turn's first: 2 matmuls hide it
    assert gather > 2 * matmul
    assert c.exposed == pytest.approx(4 * (gather - 2 * matmul), rel=1e-3)


def test_a_plan_on_this_machine_predicts_only_with_registered_cpu_figures(monkeypatch):
    """report.predict_step, which plan() calls with the compiled program: XLA:CPU's figures
    where registered, nothing otherwise (the XLA:CPU fixture stands for the compiled step)."""
    import types

    from nnxscale.planning import report
    from nnxscale.training.config import TrainConfig, with_overrides

    monkeypatch.setattr(steptime, "_REGISTERED", {})
    cfg = with_overrides(TrainConfig(), {"parallel.mesh": "fsdp=8", "data.batch_size": 16, "data.seq_len": 64})
    lay = {"setup": types.SimpleNamespace(flops_per_token=lambda: 1e6)}
    text = gzip.open(FIXTURES / "cpu_fsdp_scan.hlo.gz", "rt").read()
    assert report.predict_step(cfg, lay, {"fsdp": 8}, None, text) is None
    steptime.register_hardware("cpu", dataclasses.replace(CHIP, links={"memory": Link("memory", 1e10, 0.0, 1.0)}))
    st = report.predict_step(cfg, lay, {"fsdp": 8}, None, text)
    assert st.hardware == "test chip" and {c.link for c in st.collectives} == {"memory"}
    assert st.tokens_per_s == pytest.approx(16 * 64 / st.seconds)
    assert st.mfu == pytest.approx(1e6 * 16 * 64 / (8 * 5e14 * st.seconds))  # float32 compute: float32's peak


def test_buffers_mapped_anew_cost_time_only_where_the_runtime_maps_them():
    """XLA:CPU maps a run's temporary buffer and new outputs afresh each step (the kernel
    faults in every page): ``fresh_bytes`` over the chip's ``fresh_memory_bandwidth``, added to
    the step; an accelerator (no such figure) keeps its buffers and pays nothing. What a
    program maps anew is read from its memory analysis: a donated input's output is not."""
    import jax
    import jax.numpy as jnp

    plain = _predict(OVERLAP, fresh_bytes=2e9)
    assert plain.fresh_memory_s == 0 and plain.seconds == pytest.approx(_predict(OVERLAP).seconds)
    cpu_like = dataclasses.replace(CHIP, fresh_memory_bandwidth=1e9)
    st = _predict(OVERLAP, cpu_like, fresh_bytes=2e9)
    assert st.fresh_memory_s == pytest.approx(2.0) and st.seconds == pytest.approx(plain.seconds + 2.0)
    assert st.bottleneck.startswith("allocation-bound") and "1 GB/s" in st.bottleneck, st.bottleneck
    assert any(line.strip().startswith("buffers mapped anew") for line in steptime.format_lines(st))

    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    update = lambda a: jnp.tanh(a) * 0.9 + jnp.sin(a).sum(0)  # noqa: E731
    kept, donated = (jax.jit(update, donate_argnums=d).lower(x).compile().memory_analysis() for d in ((), 0))
    size = 256 * 1024 * 4
    assert steptime.fresh_bytes_of(kept) == kept.temp_size_in_bytes + size
    assert steptime.fresh_bytes_of(donated) == donated.temp_size_in_bytes  # written into its input
    assert steptime.fresh_bytes_of(None) == 0


def test_a_loop_to_a_count_the_data_decides_counts_at_its_most():
    """A fori_loop to a computed count (Mixtral's expert tiles on XLA:CPU) has no trip count
    to read: traced under ``expected_trips(n)`` it counts n turns; otherwise as many as the
    buffer it fills a slice a turn holds, the same as the loop to that count written as a
    constant; a loop writing where the data says (not at its counter) cannot be bounded so,
    and counts once, with a note."""
    import jax
    import jax.numpy as jnp

    def fill(n, xs, at_counter=True):
        def body(t, buf):
            row = jnp.tanh(xs[t] @ xs[t].T)
            where = t if at_counter else n % 3
            return jax.lax.dynamic_update_index_in_dim(buf, row, where, 0)

        return jax.lax.fori_loop(0, n, body, jnp.zeros((12, 64, 64), xs.dtype))

    xs = jax.ShapeDtypeStruct((12, 64, 32), jnp.float32)
    n = jax.ShapeDtypeStruct((), jnp.int32)
    text = lambda f, *a: jax.jit(f).lower(*a).compile().as_text()  # noqa: E731
    data = _predict(text(fill, n, xs))
    fixed = _predict(text(lambda xs: fill(12, xs), xs))
    assert data.flops == pytest.approx(fixed.flops) and data.flops == pytest.approx(12 * 2 * 64 * 64 * 32)
    assert any("data-dependent number of turns" in note for note in data.notes), data.notes
    anywhere = _predict(text(lambda n, xs: fill(n, xs, at_counter=False), n, xs))
    assert anywhere.flops == pytest.approx(2 * 64 * 64 * 32) and any("counted once" in note for note in anywhere.notes)

    def expecting(turns, at_counter):
        def f(n, xs):
            with steptime.expected_trips(turns):
                return fill(n, xs, at_counter)

        return f

    for at_counter in (True, False):  # what the code expects, bounded or not
        st = _predict(text(expecting(5, at_counter), n, xs))
        assert st.flops == pytest.approx(5 * 2 * 64 * 64 * 32) and any("its code expects" in note for note in st.notes)


def test_a_plan_that_waits_on_collectives_names_the_mesh_that_moves_them(monkeypatch):
    """plan(compare=True) on this machine's 8 devices, on made-up figures whose one link is
    slow enough that fsdp=8's gathers hold up the step: it plans data=8 (the fsdp axis's
    alternative), whose prediction is the one a plan of data=8 gives; where data=8 needs more
    memory than the verdict's, the line says it does not fit."""
    from nnxscale.planning import report
    from nnxscale.training.config import TrainConfig, with_overrides

    monkeypatch.setattr(steptime, "_REGISTERED", {})
    steptime.register_hardware("cpu", dataclasses.replace(CHIP, links={"memory": Link("memory", 1e7, 0.0, 1.0)}))
    cfg = with_overrides(TrainConfig(), {"model.name": "gpt2-tiny", "parallel.mesh": "fsdp=8", "parallel.min_shard_bytes": 0,
                                         "data.batch_size": 16, "data.seq_len": 32})  # fmt: skip
    p = report.plan(cfg)
    other = report.plan(with_overrides(cfg, {"parallel.mesh": "data=8"}), compare=False)
    st = p.step_time
    assert st.bottleneck.startswith("communication-bound") and steptime.worst_collective(st).axes == "fsdp"
    assert p.alternative == {"mesh": "data=8", "why": "data instead of fsdp: parameters replicated", "fits": None,
                             "peak_bytes": other.peak_bytes, "seconds": pytest.approx(other.step_time.seconds),
                             "speedup": pytest.approx(st.seconds / other.step_time.seconds)}  # fmt: skip
    said = re.search(r"; data=8 \(data instead of fsdp: parameters replicated\) is predicted (as fast|([\d.]+)x (faster|slower)): "
                     r"(.+) per step$", st.bottleneck)  # fmt: skip
    assert said and said.group(4) == steptime.format_seconds(other.step_time.seconds), st.bottleneck
    ratio = st.seconds / other.step_time.seconds
    if said.group(1) == "as fast":
        assert abs(ratio - 1) < 0.005
    else:
        assert float(said.group(2)) == pytest.approx(ratio if said.group(3) == "faster" else 1 / ratio, abs=0.005)
    assert json.loads(json.dumps(p.to_dict()))["alternative"]["mesh"] == "data=8"
    assert report.plan(cfg, compare=False).alternative is None
    assert other.peak_bytes > p.peak_bytes  # replicated parameters and optimizer state
    between = (other.peak_bytes + p.peak_bytes) // 2
    tight = report.plan(cfg, device_memory=between)
    assert tight.fits and tight.alternative["fits"] is False
    assert tight.step_time.bottleneck.endswith(f"; data=8 (data instead of fsdp: parameters replicated) does not fit: needs "
                                               f"{report.format_bytes(other.peak_bytes)} of {report.format_bytes(between)} per device")  # fmt: skip
    # model=8's all-reduces hold the step up; fsdp instead would split the batch of 4 eight ways: the plan stands, and says why not
    q = report.plan(with_overrides(cfg, {"parallel.mesh": "data=1,model=8", "data.batch_size": 4}))
    assert steptime.worst_collective(q.step_time).axes == "model"
    assert q.alternative["mesh"] == "data=1,fsdp=8" and "--batch-size 4 must be a multiple of 8" in q.alternative["error"]
    assert "seconds" not in q.alternative and "fsdp=8" not in q.step_time.bottleneck


# Across TPU slices each slice runs its own program (here 4 devices) and a collective over DCN
# is a host transfer: a send / recv pair that libtpu marks (as a 2-slice compile writes them).
_MS = ('frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_host_transfer_rendezvous="all-gather.1_0",'
       '_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_GATHER"}')
DCN = OVERLAP.replace("num_partitions=8", "num_partitions=4").replace(
    "  %ag-start = (bf16[512,4096]{1,0}, bf16[4096,4096]{1,0}) all-gather-start(%a), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true\n",
    '  %tok = token[] after-all(), frontend_attributes={MegascaleRendezvousKeyName="all-gather.1_0"}\n'
    f"  %send = (bf16[2048,4096]{{1,0}}, u32[], token[]) send(%a2, %tok), channel_id=2, is_host_transfer=true, {_MS}\n"
    f"  %recv = (bf16[4096,4096]{{1,0}}, u32[], token[]) recv(%tok), channel_id=1, is_host_transfer=true, {_MS}\n",
).replace(
    "  %ag-done = bf16[4096,4096]{1,0} all-gather-done(%ag-start)\n",
    "  %send-done = token[] send-done(%send), channel_id=2, is_host_transfer=true\n"
    "  %recv-done = (bf16[4096,4096]{1,0}, token[]) recv-done(%recv), channel_id=1, is_host_transfer=true\n"
    "  %ag-done = bf16[4096,4096]{1,0} get-tuple-element(%recv-done), index=0\n",
).replace("(a: bf16[512,4096],", "(a2: bf16[2048,4096],").replace("  %a = bf16[512,4096]{1,0} parameter(0)", "  %a2 = bf16[2048,4096]{1,0} parameter(0)")


def test_a_collective_across_tpu_slices_is_a_host_transfer_priced_on_dcn():
    """The send counts as an all-gather over the 2 slices of the gathered (4096, 4096), on the
    link between domains: half of it over DCN; asynchronous, the matmul before its recv-done
    hides part of it; named by the mesh axis that spans the slices."""
    assert hlo.megascale_slices(_MS) == 2
    assert hlo.megascale_slices('_xla_megascale_target={{100000,100001,200000,200001,300000,300001}}') == 3
    assert hlo.megascale_slices('_xla_megascale_target="{0:7}x{0:255}"') == 8
    (c,) = hlo.collectives(DCN)
    assert (c.kind, c.group, c.bytes, c.shapes) == ("all-gather", 2, MATRIX, ((4096, 4096),))
    chip = dataclasses.replace(CHIP, links={"ici": Link("ici", 1e11, 0.0, 1.0), "dcn": Link("dcn", 1e9, 0.0, 1.0)})
    where = Placement("ici", "dcn", (0, 0, 0, 0, 1, 1, 1, 1))  # the whole mesh's 8 devices, two slices of 4
    st = predict(DCN, chip, axis_links={"fsdp": "dcn"}, mesh={"fsdp": 8}, placement=where, n_devices=8, tokens_per_step=1024,
                 model_flops_per_step=0.0)  # fmt: skip
    (t,) = st.collectives
    over_dcn = 1 / 2 * MATRIX / 1e9
    matmul = 2 * 4096**3 / 1e15
    assert (t.kind, t.link, t.axes, t.count) == ("all-gather", "dcn", "fsdp", 1)
    assert t.seconds == pytest.approx(over_dcn) and t.exposed == pytest.approx(over_dcn - matmul)
    assert st.seconds == pytest.approx(matmul + (over_dcn - matmul) + 3 * MATRIX / 1e12)  # the recv is not an HBM op
    assert "the fsdp all-gathers cross dcn" in st.bottleneck
    # Inside a slice, the per-slice program's groups are read against the mesh's inner factors:
    # data=2 spans the slices (axis outermost), fsdp=4 lies inside each.
    inside = OVERLAP.replace("num_partitions=8", "num_partitions=4").replace("{{0,1,2,3,4,5,6,7}}", "{{0,1,2,3}}")
    (t,) = predict(inside, chip, axis_links={"data": "dcn", "fsdp": "ici"}, mesh={"data": 2, "fsdp": 4}, placement=where,
                   n_devices=8, tokens_per_step=1024, model_flops_per_step=0.0).collectives  # fmt: skip
    assert (t.link, t.axes) == ("ici", "fsdp")
