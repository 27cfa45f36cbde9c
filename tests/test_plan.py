"""The planner: per-device figures that equal the real arrays, the compiler's own memory and
collectives, meshes larger than this machine, the verdict, and the command line."""

import json
import math

import jax
import pytest

from nnxscale.planning import meshes, report
from nnxscale.cli.commands import main
from nnxscale.training.config import ConfigError, FLAT_NAMES, TrainConfig, with_overrides
from nnxscale.training.state import init_state, setup
from nnxscale.training.step import make_train_step


def tiny(mesh: str, **fields) -> TrainConfig:
    """gpt2-tiny, batch 16 x 64; its tensors are kilobytes, so the FSDP minimum is off."""
    base = {"model": "gpt2-tiny", "mesh": mesh, "min_shard_bytes": 0, "data.batch_size": 16, "data.seq_len": 64}
    return with_overrides(TrainConfig(), {FLAT_NAMES.get(k, k): v for k, v in {**base, **fields}.items()})


def compiler_memory(cfg: TrainConfig):
    """``memory_analysis()`` of the real train step, compiled ahead of time with JAX's own API
    (under the run's mesh, as the trainer calls it: the same program, so a cache hit after a plan)."""
    s = setup(cfg)
    with jax.set_mesh(s.mesh):
        return make_train_step(s).lower(s.abstract, s.abstract_batch).compile().memory_analysis()


def shard_bytes_on_device0(tree) -> int:
    """Bytes the first device really holds of every array in ``tree``."""
    device = jax.devices()[0]
    return sum(
        math.prod(s.data.shape) * s.data.dtype.itemsize
        for leaf in jax.tree.leaves(tree)
        for s in leaf.addressable_shards
        if s.device == device
    )


@pytest.mark.parametrize("mesh", ["fsdp=8", "data=2,model=4", "data=8"])
def test_layout_figures_are_what_the_devices_really_hold(mesh):
    cfg = tiny(mesh)
    p = report.plan(cfg, compile="never")
    s = setup(cfg)
    state = init_state(s)
    assert p.param_bytes == shard_bytes_on_device0(state["params"])
    assert p.optimizer_bytes == shard_bytes_on_device0(state["opt_state"])
    assert p.gradient_bytes == p.param_bytes
    batch = {k: jax.device_put(jax.numpy.zeros(v.shape, v.dtype), v.sharding) for k, v in s.abstract_batch.items()}
    assert p.batch_bytes == shard_bytes_on_device0(batch)
    if mesh != "data=8":
        assert p.param_bytes < p.full_param_bytes  # the layout is really split
    assert p.num_params == s.model.config.num_params() == s.num_params and p.full_param_bytes == 4 * p.num_params


def test_compiled_figures_come_from_the_compiler():
    cfg = tiny("fsdp=8", model="gpt2-mini", **{"data.batch_size": 32, "data.seq_len": 256})
    p = report.plan(cfg, device_memory=1 << 30)
    assert p.source == "compiler" and p.compile_seconds > 0
    # The compiler's own figures, read here without the planner: the real step compiled.
    ma = compiler_memory(cfg)
    assert p.temp_bytes == ma.temp_size_in_bytes
    assert p.peak_bytes == ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    # peak = the donated state and the batch, plus the step's temporaries (gradients among them)
    assert p.peak_bytes >= p.param_bytes + p.optimizer_bytes + p.batch_bytes + p.temp_bytes - (64 << 10)
    assert p.temp_bytes >= p.gradient_bytes
    # FSDP gathers the parameters (twice) and reduces the gradients: about three times the parameters
    assert 2.0 <= p.collective_total / p.full_param_bytes <= 3.5
    textbook = dict(p.textbook)  # FSDP for what has an embed axis; the heads' and MLP's biases stay whole
    assert textbook["FSDP 2 gathers + reduce-scatter"] > 2.5 and 2.5 < sum(textbook.values()) <= 3.0
    # the residual stream is split along the batch, like the data
    residual = next(a for a in p.activations if a["names"] == ["batch", "length", "embed"])
    assert residual["spec"] == "P('fsdp', None, None)" and residual["shape"] == [32, 256, 128]
    # the analytical estimate, shown beside the compiler's figures, is close to them here
    assert abs(p.estimated["peak_bytes_per_device"] / p.peak_bytes - 1) < 0.1
    assert abs(p.estimated["collective_bytes_per_step"] / p.collective_total - 1) < 0.15
    assert p.fits is True and "fits: peak" in str(p)
    # FLOPs: the compiled program's products, loop bodies once per trip, are the model's formula
    # and the attention's products again (remat none recomputes the attention's core, no weight
    # matmul; the formula's attention term is XLA's unmasked attention)
    assert abs(p.flops / p.flops_recompute - 1) < 0.02 and p.flops > p.flops_expected
    out = p.to_dict()
    for key in ("peak_bytes_per_device", "param_bytes_per_device", "optimizer_bytes_per_device",
                "collective_bytes_per_step", "source"):  # fmt: skip
        assert key in out
    assert out["collective_bytes_per_step"] == p.collective_total


def test_a_mesh_larger_than_this_machine_compiles_in_a_child_process():
    eight, sixteen = report.plan(tiny("fsdp=8")), report.plan(tiny("fsdp=16"))
    assert sixteen.source == "compiler (child process, 16 CPU devices)"
    assert sixteen.mesh == {"fsdp": 16}
    # FSDP halves what each device holds of the split parameters; the layout says exactly how much
    assert sixteen.param_bytes < eight.param_bytes
    assert sixteen.peak_bytes < eight.peak_bytes
    assert jax.device_count() == 8  # nothing changed in this process


def test_beyond_the_compile_limit_the_estimate_answers():
    p = report.plan(tiny("fsdp=128", **{"data.batch_size": 128}), max_compile_devices=64)
    assert p.source == "estimate" and p.compile_seconds is None
    assert any("more than --max-compile-devices 64" in n for n in p.notes)
    assert p.peak_bytes >= p.param_bytes + p.optimizer_bytes + p.gradient_bytes
    assert p.to_dict()["sources"]["param_bytes"] == "layout"


def test_the_estimate_counts_accumulated_gradients_reduced_as_the_step_reduces_them():
    """With --grad-accum, the estimate's collectives follow the compiled step: a family's own
    loss sums the replicated weights' gradients unreduced and all-reduces them once per step
    (data=8: as many bytes as one micro-batch's), FSDP reduces per micro-batch (4x), and a
    mixture, whose router losses couple a batch's tokens, all-reduces per micro-batch (4x)."""
    from nnxscale.planning import estimate

    def coll(model, mesh, accum):
        cfg = tiny(mesh, model=model, **{"data.batch_size": 32, "optim.grad_accum": accum})
        return estimate.estimate(cfg)["collective_bytes_by_kind"]["all (estimate)"]

    assert coll("gpt2-tiny", "data=8", 4) == pytest.approx(coll("gpt2-tiny", "data=8", 1))
    assert coll("gpt2-tiny", "fsdp=8", 4) == pytest.approx(4 * coll("gpt2-tiny", "fsdp=8", 1))
    assert coll("mixtral-tiny", "data=8", 4) == pytest.approx(4 * coll("mixtral-tiny", "data=8", 1))


def test_the_verdict_and_device_memory():
    assert report.parse_bytes("16GiB") == 16 << 30
    assert report.parse_bytes("80 GB") == 80 * 10**9
    assert report.device_memory(None, "h100") == 80 << 30
    for bad in ("lots", "-3GiB", "0"):
        with pytest.raises(ConfigError):
            report.parse_bytes(bad)
    with pytest.raises(ConfigError, match="unknown device 'tpu-v9'.*h100"):
        report.device_memory(None, "tpu-v9")
    p = report.plan(tiny("data=8"), device_memory=1 << 20, compile="never")
    assert p.fits is False and "does not fit" in str(p)
    with pytest.raises(ConfigError, match="--batch-size 12 must be a multiple of 8"):
        report.plan(tiny("data=8", **{"data.batch_size": 12}), compile="never")


def test_plan_command_json_sweep_and_errors(capsys, rules_built, monkeypatch):
    args = ["plan", "--model", "gpt2-tiny", "--mesh", "fsdp=8", "--batch-size", "16", "--seq-len", "64",
            "--min-shard-bytes", "0", "--device-memory", "1GiB", "--table", "--json"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    last = json.loads(out.strip().splitlines()[-1])  # the JSON line comes last, after the table
    assert last["mesh"] == "fsdp=8" and last["fits"] is True and last["source"] == "compiler"
    assert "activations (logical names" in out and "lint:" in out
    assert "h.mlp.c_fc.kernel" in out  # the per-Variable view stays available
    # The layout, the compiled step, the table and the lint all asked the rules resolved once at setup.
    assert rules_built == [{"fsdp": 8}]

    from nnxscale.sharding import state as sharding_state

    traced = []  # the sweep traces each remat policy's model once, whatever the number of meshes
    eval_shape = sharding_state.nnx.eval_shape
    monkeypatch.setattr(sharding_state.nnx, "eval_shape", lambda f, *a, **k: traced.append(1) or eval_shape(f, *a, **k))
    assert main(["plan", "--model", "gpt2-tiny", "--mesh", "data=8", "--batch-size", "16", "--seq-len", "64", "--sweep", "--json"]) == 0
    out = capsys.readouterr().out
    swept = json.loads(out.strip().splitlines()[-1])
    plans = swept["plans"]
    assert len(traced) == 3 < len(plans), (len(traced), len(plans))
    assert swept["not_planned"] == []  # a batch of 16 splits over every 8-way mesh
    # each configuration once (a pipeline mesh once per schedule: docs/pipelines.md)
    assert len({(p["mesh"], p["remat"], (p["pipeline"] or {}).get("schedule")) for p in plans}) == len(plans)
    assert len({p["mesh"] for p in plans}) >= 4 and len({p["remat"] for p in plans}) == 3
    # The sweep estimates (no compile): each figure within 15% of (bench/plan_accuracy.py: 12% worst fitted)
    # the compiler's for that configuration (checked on two of them).
    for mesh, remat in (("data=8", "none"), ("fsdp=8", "full")):
        (swept,) = [p for p in plans if p["mesh"] == mesh and p["remat"] == remat]
        assert swept["source"] == "estimate"
        ma = compiler_memory(tiny(mesh, remat=remat, min_shard_bytes=TrainConfig().parallel.min_shard_bytes))
        peak = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
        assert abs(swept["peak_bytes_per_device"] / peak - 1) < 0.15, (mesh, remat, swept["peak_bytes_per_device"], peak)

    # A candidate that cannot run the configuration is named with the reason, not dropped:
    # a batch of 4 splits over none of the 8-way meshes.
    assert main(["plan", "--model", "gpt2-tiny", "--mesh", "data=8", "--batch-size", "4", "--seq-len", "64", "--sweep", "--json"]) == 0
    out = capsys.readouterr().out
    assert "not planned: data=8: --batch-size 4 must be a multiple of 8" in out, out
    skipped = {s["mesh"]: s["reason"] for s in json.loads(out.strip().splitlines()[-1])["not_planned"]}  # and in the JSON
    assert skipped["data=8"].startswith("--batch-size 4 must be a multiple of 8") and "fsdp=8" in skipped
    assert "not planned: fsdp=8: --batch-size 4" in out, out
    assert any(line.startswith("data=4,model=2 ") for line in out.splitlines()), out  # 4 rows over data=4: planned

    assert main(["plan", "--model", "gpt2-tiny", "--device", "tpu-v9"]) == 2
    assert "unknown device 'tpu-v9'" in capsys.readouterr().err


def test_plan_takes_a_hugging_face_directory_like_train(capsys):
    """`--model DIR` names a Hugging Face directory in `plan` as in `train` (transformers'
    own GPT-2 fixture): its architecture is planned."""
    from pathlib import Path

    model_dir = Path(__file__).parent / "data" / "hf_gpt2" / "model"
    code = main(["plan", "--model", str(model_dir), "--mesh", "fsdp=8", "--seq-len", "16", "--batch-size", "8",
                 "--compile", "never", "--json"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    plan = json.loads(out.strip().splitlines()[-1])
    assert plan["model"] == str(model_dir) and plan["num_params"] == 96 * 32 + 64 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32



def test_plan_dumps_the_compiled_program_its_figures_are_read_from(tmp_path, capsys):
    """``plan --dump-hlo DIR``: the compiled step's text, whose collectives are the plan's; an
    estimated plan has no program to write, and says so in one line."""
    from test_cli import assert_one_error_line, run_main

    from nnxscale.planning import hlo

    args = ["plan", "--model", "gpt2-tiny", "--mesh", "fsdp=8", "--batch-size", "8", "--seq-len", "64",
            "--min-shard-bytes", "0", "--json"]  # fmt: skip
    code, out, err = run_main(capsys, [*args, "--dump-hlo", str(tmp_path / "hlo")])
    assert code == 0, err
    text = (tmp_path / "hlo" / "step.hlo.txt").read_text()
    assert text.startswith("HloModule") and f"to {tmp_path / 'hlo' / 'step.hlo.txt'}" in out
    planned = json.loads(out.strip().splitlines()[-1])["collective_bytes_by_kind"]
    assert planned.get("all-gather", 0) > 0 and hlo.collective_bytes(text) == planned
    code, _, err = run_main(capsys, [*args, "--compile", "never", "--dump-hlo", str(tmp_path / "none")])
    assert_one_error_line(code, err, "--dump-hlo", "estimated", "--compile always")
    assert not (tmp_path / "none").exists()
