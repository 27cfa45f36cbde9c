"""plan --target: the step compiled by an accelerator's own compiler on this CPU machine.

GPU targets compile tiny models deviceless in seconds (the CUDA plugin of the ``cuda12``
extra; tests that need it are marked ``needs_cuda_plugin``); TPU compiles take tens of
seconds even for tiny programs, so they are checked in ``bench/targets.py`` and
docs/targets.md, not here."""

import dataclasses
import importlib.util

import pytest

from nnxscale.cli.commands import main
from nnxscale.planning import meshes, targets
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
    assert p.flops == compiled_flops(compiled, "gpu") > 0 and p.flops_expected > 0
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
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("libtpu", "jax_plugins.xla_cuda12") else real(name, *a))
    assert main(["plan", "--model", "gpt2-tiny", "--target", "v5p-8"]) == 2
    assert "pip install 'nnxscale[tpu]'" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt2-tiny", "--target", "h100x8"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'nnxscale[cuda12]'" in err and len(err.strip().splitlines()) == 1


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
