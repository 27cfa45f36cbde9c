"""plan --target: the step compiled by an accelerator's own compiler on this CPU machine.

GPU targets compile tiny models deviceless in seconds (the CUDA plugin of the ``cuda12``
extra; tests that need it are marked ``needs_cuda_plugin``); TPU compiles take tens of
seconds even for tiny programs, so they are checked in ``bench/targets.py`` and
docs/targets.md, not here."""

import dataclasses
import importlib.util
import math
import os
import re

import pytest

from nnxscale.cli.commands import main
from nnxscale.planning import compiler, estimate, meshes, report, targets
from nnxscale.planning.compiler import compile_step, compiled_flops, measure
from nnxscale.planning.report import plan
from nnxscale.training.config import FLAT_NAMES, TrainConfig, with_overrides


def tiny(mesh: str, **fields) -> TrainConfig:
    """gpt2-tiny, batch 16 x 64, bfloat16 compute over float32 weights; FSDP splits its kilobyte tensors."""
    base = {"model": "gpt2-tiny", "mesh": mesh, "min_shard_bytes": 0, "data.batch_size": 16, "data.seq_len": 64, "dtype": "bfloat16"}
    return with_overrides(TrainConfig(), {FLAT_NAMES.get(k, k): v for k, v in {**base, **fields}.items()})


@pytest.fixture(scope="module")
def h100x8_plan():
    return plan(tiny("fsdp=8"), target="h100x8")


# The suite's persistent compilation cache cannot load a deviceless GPU executable: it compiles again, and says so.
@pytest.mark.needs_cuda_plugin
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
def test_plan_target_h100x8_reports_the_gpu_compilers_own_figures(h100x8_plan):
    p = h100x8_plan
    target = targets.get("h100x8")
    assert p.target == "h100x8" and "XLA:GPU" in p.source and p.device_memory == target.memory
    # The same program compiled here, on the target's devices, read without the planner.
    mesh = targets.device_mesh({"fsdp": 8}, target, target.devices())
    assert {d.platform for d in mesh.devices.flat} == {"gpu"} and {d.device_kind for d in mesh.devices.flat} == {"NVIDIA H100 80GB HBM3"}
    _, compiled = compile_step(tiny("fsdp=8"), mesh)
    ma = compiled.memory_analysis()
    assert p.peak_bytes == ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    assert p.collective_bytes == measure(compiled, "gpu")["collective_bytes"] and p.collective_bytes["reduce-scatter"] > 0
    assert p.flops == compiled_flops(compiled) > 0 and p.flops_expected > 0
    # the attention is a Pallas kernel (a custom call): named, not counted
    assert p.flops_uncounted == ["__gpu$xla.gpu.triton"] and "not counted: the matmuls inside __gpu$xla.gpu.triton" in str(p)
    # the textbook in the dtypes this compiler moves (bfloat16 gathers and gradients) is what it counted
    assert abs(sum(x for _, x in p.textbook) / (p.collective_total / p.full_param_bytes) - 1) < 0.1
    # bfloat16 compute over float32 master weights: the state is float32, the program computes in bf16.
    assert p.full_param_bytes == 4 * p.num_params and "bf16[" in compiled.as_text()
    # The attention the plan names is the one the target's program runs (not this CPU's choice).
    assert p.attention in ("cudnn", "pallas-gpu") and p.attention in p.attention_line
    kernel = "__gpu$xla.gpu.triton" if p.attention == "pallas-gpu" else "__cudnn$fmha"
    assert kernel in compiled.as_text()
    assert p.fits is True and "verdict: fits" in str(p)
    # XLA:GPU compiles a program larger than the GPU without a word: the plan checks.
    small = dataclasses.replace(p, device_memory=p.peak_bytes - 1)
    assert small.fits is False and "does not fit" in str(small)


@pytest.mark.needs_cuda_plugin
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
def test_plan_target_predicts_the_step_time_from_the_compiled_program(h100x8_plan):
    p = h100x8_plan
    st = p.step_time
    assert st is not None and st.hardware == "NVIDIA H100 80GB HBM3" and st.seconds > 0
    assert st.seconds == pytest.approx(st.compute_s + st.memory_s + st.overhead_s + st.exposed_collective_s)
    assert st.tokens_per_s == pytest.approx(16 * 64 / st.seconds) and 0 < st.mfu < 1
    # the Pallas attention kernel's products are estimated from its operands: the walk counts more than the dots
    assert st.kernel_flops > 0 and st.flops == pytest.approx(p.flops + st.kernel_flops)
    assert "step time on h100x8" in str(p) and f"bottleneck: {st.bottleneck}" in str(p)
    assert p.to_dict()["step_time"]["seconds"] == st.seconds
    # ranked by time: a slower copy goes after it, one that does not fit last
    slow = dataclasses.replace(p, step_time=dataclasses.replace(st, seconds=2 * st.seconds))
    big = dataclasses.replace(p, device_memory=p.peak_bytes - 1)
    assert meshes.sweep_table([p]).splitlines()[0].split()[-3:] == ["step", "tokens/s/dev", "MFU"]
    from nnxscale.planning.steptime import rank_by_time

    assert rank_by_time([big, slow, p]) == [p, slow, big]


@pytest.mark.needs_cuda_plugin
def test_the_mesh_is_laid_onto_the_targets_nodes():
    target = targets.get("h100x16")  # two nodes of 8
    devices = target.devices()
    mesh = targets.device_mesh({"data": 2, "model": 8}, target, devices)
    for row in mesh.devices:  # each model group is one node's 8 GPUs
        assert len({d.process_index for d in row}) == 1
    assert len({row[0].process_index for row in mesh.devices}) == 2
    (note,) = targets.placement_notes({"data": 2, "model": 8}, target)
    assert "across its 2 nodes (InfiniBand): data 2; inside each node (NVLink 4, 900 GB/s per GPU): model 8" in note
    # fsdp=16 spans the nodes: said, and the node boundary is its outer factor.
    mesh = targets.device_mesh({"fsdp": 16}, target, devices)
    assert [d.process_index for d in mesh.devices.flat] == [0] * 8 + [1] * 8
    (note,) = targets.placement_notes({"fsdp": 16}, target)
    assert "(InfiniBand): fsdp 2; inside each node (NVLink 4, 900 GB/s per GPU): fsdp 8" in note
    assert "model crosses nodes" in targets.placement_notes({"data": 1, "model": 16}, target)[1]
    assert targets.placement_notes({"fsdp": 8}, targets.get("h100x8")) == ["mesh on h100x8: every axis inside one node (NVLink 4, 900 GB/s per GPU)"]


def test_a_sweep_for_a_target_keeps_model_and_context_inside_a_node():
    target = targets.get("h100x16")
    candidates = meshes.for_target(meshes.candidate_meshes(16, 8, 16384), target)
    assert "fsdp=2,context=8" in candidates and "data=2,model=8" in candidates
    assert not any(m.startswith(("context", "model")) and "," in m for m in candidates)  # inner axes last
    assert "context=16" not in candidates  # it would cross the nodes


def test_the_mesh_compared_with_a_step_that_waits_on_collectives():
    """targets.alternative_mesh: the axes whose collectives expose the most, moved: inside a
    node with data across, else a per-layer axis into fsdp, fsdp into data, data into fsdp;
    the same devices, each proposal laid onto the target's nodes as a plan of it would be."""
    h16, h8, v5e = targets.get("h100x16"), targets.get("h100x8"), targets.get("2xv5e-256")
    alt = targets.alternative_mesh
    assert alt({"fsdp": 16}, ["fsdp"], True, h16) == ({"data": 2, "fsdp": 8}, "fsdp inside each node, data across nodes")
    assert alt({"data": 2, "fsdp": 16}, ["fsdp"], True, targets.get("h100x32"))[0] == {"data": 4, "fsdp": 8}
    assert alt({"fsdp": 512}, ["fsdp"], True, v5e) == ({"data": 2, "fsdp": 256}, "fsdp inside each slice, data across slices")
    assert alt({"data": 2, "model": 8}, ["model"], False, h16) == ({"data": 2, "fsdp": 8}, "fsdp instead of model")
    assert alt({"fsdp": 2, "context": 8}, ["context"], False, h16)[0] == {"fsdp": 16}  # fsdp keeps its place
    assert alt({"fsdp": 8}, ["fsdp"], False, h8) == ({"data": 8}, "data instead of fsdp: parameters replicated")
    assert alt({"data": 8}, ["data"], False, h8)[0] == {"fsdp": 8}
    assert alt({"data": 2, "fsdp": 8}, ["data"], True, h16)[0] == {"fsdp": 16}  # data's all-reduce across: fsdp's instead
    assert alt({"data": 8}, ["data"], False, None)[0] == {"fsdp": 8}  # no target (XLA:CPU): the same rules but the first
    assert alt({"stage": 2, "data": 4}, ["stage"], False, h8) is None  # a pipeline's permutes: its own sweep
    assert alt({"fsdp": 8}, [], False, h8) is None  # groups not placed on the mesh: nothing to move
    for sizes, axes, across, target in (({"fsdp": 16}, ["fsdp"], True, h16), ({"data": 2, "model": 8}, ["model"], False, h16)):
        proposed, _ = alt(sizes, axes, across, target)
        assert math.prod(proposed.values()) == target.chips
        spans = targets.split_over_domains(proposed, target)
        assert all(spans.get(a, 1) == 1 for a in axes if a in proposed and a != "data")  # the moved axis stays inside


def test_target_names_and_the_list(capsys):
    assert main(["plan", "--list-targets"]) == 0
    out = capsys.readouterr().out
    for name in ("h100x8", "h100x64", "b200x8", "v5p-128", "v6e-256", "2xv6e-256"):
        assert f"\n{name} " in out, name
    assert targets.get("v5p-8").chips == 4 and targets.get("v5e-8").chips == 8  # v5p names count cores, v5e chips
    assert targets.get("2xv6e-256").chips == 512 and targets.get("h100x64").topology == "1x8x8"
    assert main(["plan", "--model", "gpt2-tiny", "--target", "tpu9"]) == 2
    err = capsys.readouterr().err
    assert "unknown target 'tpu9'" in err and "h100x8" in err and "v5p-8" in err and len(err.strip().splitlines()) == 1
    assert main(["plan", "--model", "gpt2-tiny", "--target", "h100x12"]) == 2
    assert "whole nodes of 8" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt2-tiny", "--target", "v5p-12"]) == 2
    assert "v5p-8, v5p-16" in capsys.readouterr().err


@pytest.mark.needs_cuda_plugin  # without it, the missing extra is the one line
def test_a_mesh_that_does_not_divide_the_target_is_one_line(capsys):
    assert main(["plan", "--model", "gpt2-tiny", "--mesh", "fsdp=16", "--target", "h100x8"]) == 2
    err = capsys.readouterr().err
    assert "mesh fsdp=16 has 16 devices; h100x8 has 8 chips" in err and len(err.strip().splitlines()) == 1


def test_without_the_extra_target_names_it(capsys, monkeypatch):
    real = importlib.util.find_spec
    hidden = ("libtpu", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a))
    assert main(["plan", "--model", "gpt2-tiny", "--target", "v5p-8"]) == 2
    assert "pip install 'nnxscale[tpu]'" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt2-tiny", "--target", "h100x8"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'nnxscale[cuda13]'" in err and len(err.strip().splitlines()) == 1


#: What libtpu 0.0.42.1 said (2026-11-26, v5e-8, deviceless) for arguments, outputs and
#: temporaries larger than a chip, and its longer form (a template in the same libtpu).
REFUSALS = [
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (20.00G) exceeds "
     "available HBM (15.75G).", 20 << 30, int(15.75 * (1 << 30)), []),
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (80.00G) exceeds "
     "available HBM (15.75G).", 80 << 30, int(15.75 * (1 << 30)), []),
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 17.50G of 15.75G "
     "hbm. Exceeded hbm capacity by 1.75G.\n\nTotal hbm usage >= 18.01G:\n    reserved        530.00M\n\n"
     "  Largest program allocations in hbm:\n\n  1. Size: 4.00G\n     Operator: op_name=\"jit(step)/dot_general\"\n"
     "  2. Size: 2.00G\n", int(17.5 * (1 << 30)), int(15.75 * (1 << 30)), ["1. Size: 4.00G", "2. Size: 2.00G"]),
]  # fmt: skip


@pytest.mark.parametrize("message,needs,available,buffers", REFUSALS)
def test_the_tpu_compilers_refusal_is_read(message, needs, available, buffers):
    r = compiler.refusal(message)
    assert (r["needs"], r["available"], r["buffers"]) == (needs, available, buffers)
    assert r["first_line"].startswith("RESOURCE_EXHAUSTED")
    assert compiler.refusal("RESOURCE_EXHAUSTED: something else")["needs"] is None


def test_a_refused_plan_shows_what_the_compiler_said_and_no_zeros(monkeypatch):
    message, needs, available, _ = REFUSALS[0]
    refused = {"refused": compiler.refusal(message), "compile_seconds": 1.0, "source": "compiler (v5e-8: XLA:TPU, libtpu, deviceless)"}
    monkeypatch.setattr(report, "compile_for_target", lambda cfg, target: refused)
    p = plan(tiny("fsdp=8"), target="v5e-8")
    text = str(p)
    assert p.fits is False and p.peak_bytes == needs
    assert re.search(r"needs, as the compiler refused it +20.0 GiB .*: of 15.8 GiB per chip", text)
    assert "verdict: does not fit: needs 20.0 GiB of 15.8 GiB per chip" in text
    assert not re.search(r"\b0 B\b", text) and "total" not in text  # nothing measured is shown as zero
    # A refusal that names no sizes: its first line, still no zeros.
    refused["refused"] = compiler.refusal("RESOURCE_EXHAUSTED: something else")
    text = str(plan(tiny("fsdp=8"), target="v5e-8"))
    assert "verdict: does not fit: RESOURCE_EXHAUSTED: something else" in text and not re.search(r"\b0 B\b", text)


def test_the_textbook_counts_the_bytes_each_compiler_moves():
    """bfloat16 compute over float32 weights: XLA:CPU moves the collectives as float32 (3x the
    parameters for FSDP, as counted); the accelerators' compilers gather bfloat16 and reduce
    bfloat16 gradients (the embedding table's in float32)."""
    p = plan(tiny("fsdp=8"), compile="never")
    full, rows = p.full_param_bytes, p.layout["rows"]
    cpu = dict(estimate.textbook_collectives(p.layout["setup"].cfg, p.layout, "cpu"))
    gpu = dict(estimate.textbook_collectives(p.layout["setup"].cfg, p.layout, "gpu"))
    table = sum(4 * math.prod(r.shape) for r in rows if r.logical and "vocab" in r.logical)
    split = cpu["FSDP 2 gathers + reduce-scatter"] * full / 3  # the bytes FSDP splits, all float32 on XLA:CPU
    assert 0.95 * full < split <= full
    # gathered twice at half the bytes, reduced at half but for the embedding table
    assert gpu["FSDP 2 gathers + reduce-scatter"] * full == pytest.approx(split + (split - table) / 2 + table)


def test_gradient_accumulation_is_named_in_the_textbook_and_the_notes():
    """--grad-accum 4: FSDP's gathers and reduce-scatters happen in every micro-batch (the
    accumulator is sharded), and the plan says so; a data axis's all-reduce happens once per
    step (the textbook's), and no note says otherwise."""
    one, four = (plan(tiny("fsdp=8", **{"optim.grad_accum": a, "data.batch_size": 32}), compile="never") for a in (1, 4))
    assert dict(four.textbook)["FSDP 2 gathers + reduce-scatter x 4 micro-batches"] == pytest.approx(
        4 * dict(one.textbook)["FSDP 2 gathers + reduce-scatter"])
    (note,) = [n for n in four.notes if n.startswith("--grad-accum 4")]
    assert "each of the 4 micro-batches" in note and "inherent" in note
    assert not any(n.startswith("--grad-accum") for n in one.notes)
    data = plan(tiny("data=8", **{"optim.grad_accum": 4, "data.batch_size": 32}), compile="never")
    assert not any(n.startswith("--grad-accum") for n in data.notes), data.notes
    assert dict(data.textbook)["data-parallel gradient all-reduce"] == pytest.approx(1.0, abs=0.01)


def test_on_a_data_axis_accumulated_gradients_are_reduced_once_per_step():
    """data=8, --grad-accum 2 (XLA:CPU): the compiled step all-reduces the bytes it does with one
    micro-batch, not twice them (each replica sums its gradients unreduced; once per micro-batch
    before 2026-11-26: 2.06x the parameter bytes)."""
    from nnxscale.planning import hlo

    def reduced(accum):
        _, compiled = compile_step(tiny("data=8", **{"optim.grad_accum": accum}))
        found = hlo.collectives(compiled.as_text())
        return sum(c.total_bytes for c in found if c.kind in ("all-reduce", "reduce-scatter"))

    one, two = reduced(1), reduced(2)
    assert one > 0 and two <= 1.03 * one, (one, two)


def test_the_plugins_start_up_chatter_is_kept_from_plan(capfd):
    """What the CUDA plugin and libtpu write to stderr (from C++) while failing to find their
    hardware: held back where only the CPU started; passed on with an error."""
    from nnxscale.cli.commands import _start_jax_quietly
    from nnxscale.errors import ConfigError

    def chatter():
        os.write(2, b"I0000 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.\n")

    note = _start_jax_quietly(chatter, forced_cpu=False)
    assert "no GPU or TPU started here" in note and "NNXSCALE_DEBUG=1" in note
    assert capfd.readouterr().err == ""
    assert _start_jax_quietly(chatter, forced_cpu=True) is None and capfd.readouterr().err == ""  # --target
    assert _start_jax_quietly(lambda: None, forced_cpu=False) is None  # nothing said, nothing to note

    def broken():
        chatter()
        raise RuntimeError("the backend did not start")

    with pytest.raises(RuntimeError):
        _start_jax_quietly(broken, forced_cpu=False)
    assert "Could not find cuda drivers" in capfd.readouterr().err  # a real failure keeps its story

    def bad_input():
        chatter()
        raise ConfigError("--cpu-devices must be positive")

    with pytest.raises(ConfigError):
        _start_jax_quietly(bad_input, forced_cpu=False)
    assert capfd.readouterr().err == ""  # its one line is printed by main


@pytest.mark.needs_cuda_plugin
def test_in_bfloat16_the_losss_head_gradient_is_reduced_in_bfloat16_on_h100s():
    """The loss in 4 vocabulary slices, bfloat16 compute over a float32 head split by FSDP,
    compiled by the H100 compiler: the head's gradient crosses the GPUs in bfloat16, as the
    other weights' do (a float32 product cast afterwards was reduced in float32, twice the
    bytes: llama-3.2-1b's tied head, issue 31). XLA:CPU promotes bfloat16 reductions to
    float32, so only a target's compiler shows it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import nnxscale
    from nnxscale.layers import loss as losslib
    from nnxscale.planning import hlo

    target = targets.get("h100x8")
    mesh = targets.device_mesh({"fsdp": 8}, target, target.devices())
    rules = nnxscale.resolve("auto", mesh, min_shard_bytes=0)
    B, T, C, V = 8, 32, 64, 1024
    hidden = jax.ShapeDtypeStruct((B, T, C), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    head = jax.ShapeDtypeStruct((C, V), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    targets_ = jnp.zeros((B, T), jnp.int32)

    def loss(h, w):
        with nnxscale.use_rules(rules):
            return losslib.chunked_cross_entropy(h, targets_, w, chunks=4)

    grad = jax.jit(jax.grad(loss, argnums=1), out_shardings=NamedSharding(mesh, P("fsdp")))
    text = grad.lower(hidden, head).compile().as_text()
    reduced = sum(c.total_bytes for c in hlo.collectives(text) if c.kind in ("all-reduce", "reduce-scatter"))
    assert 0 < reduced <= 1.02 * C * V * 2, reduced / (C * V * 4)


def test_a_target_compile_that_fails_is_one_error_naming_the_childs_line():
    """The child that compiles for a target fails: a CompileError (an NnxscaleError: one line
    from the command line, no traceback) with the child's own error line, not a RuntimeError."""
    from nnxscale.errors import CompileError, NnxscaleError
    from nnxscale.planning.compiler import _run_child

    with pytest.raises(CompileError, match=r"compiling the step for h100x8 failed: KeyError: 'config'") as e:
        _run_child({"not a request": 1}, {}, "for h100x8")
    assert isinstance(e.value, NnxscaleError)
