"""Training through a pipeline: the trainer, checkpoints, the command line and the planner.

The schedules themselves are tested in ``test_pipeline.py``; here the whole run. Every run
is the byte-level ``gpt2-mini`` (4 layers, so 2 stages x 2 repeats) on a ~280 KB text
file, batch 16 x 32, a few steps, dropout off, against the same run on ``data=8``:
pipelined runs log the same losses and gradient norms, and a checkpoint moves into and
out of a circular pipeline with the run continuing as if it never had.
"""

import dataclasses
import shutil

import numpy as np
import pytest
from flax import nnx
from test_cli import assert_one_error_line, run_main, train_args

import nnxscale
from nnxscale.checkpoint.checkpointer import checkpoint_dir
from nnxscale.training.config import FLAT_NAMES, TrainConfig, with_overrides
from nnxscale.planning.report import plan
from nnxscale.training.loop import train
from nnxscale.training.rundir import read_metrics
from nnxscale.errors import ConfigError
from nnxscale.layers.pipeline import Pipeline, pipeline_cost

STEPS = 4
# Circular, beside FSDP and tensor parallelism (stage=2,data=4 and GPipe: test_pipeline's schedules).
CIRCULAR = {"mesh": "stage=2,fsdp=2,model=2", "microbatches": 4, "pipeline_repeats": 2}


def cfg_for(run_dir, data, model="gpt2-mini", **overrides) -> TrainConfig:
    """``model`` on data=8, batch 16 x 32, a schedule whose first steps do not depend on --steps."""
    fields = {
        "model": model, "mesh": "data=8", "min_shard_bytes": 0, "steps": STEPS, "log_every": 1,
        "eval_every": 0, "save_every": 2, "run_dir": str(run_dir), "data.data": str(data),
        "data.seq_len": 32, "data.batch_size": 16, "optim.warmup_steps": 2, "optim.min_lr_ratio": 1.0,
        "optim.decay_steps": 100,  # not the first command's --steps: runs of 2 and 4 steps share a schedule
    }  # fmt: skip
    fields.update(overrides)
    return with_overrides(TrainConfig(), {FLAT_NAMES.get(k, k): v for k, v in fields.items()})


def quiet(cfg, logs=None):
    return train(cfg, progress=False, log=(logs.append if logs is not None else lambda _: None))


def assert_same_run(got, want, what):
    assert [r["step"] for r in got] == [r["step"] for r in want], what
    for a, b in zip(got, want):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5, err_msg=f"{what} step {a['step']}")
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-4, err_msg=f"{what} step {a['step']}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_data):
    """gpt2-mini on data=8, STEPS steps, checkpoints at 2 and 4."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    quiet(cfg_for(run_dir, text_data))
    records = read_metrics(run_dir)
    assert len({r["loss"] for r in records}) == STEPS  # it learns: the steps differ
    return run_dir, records


@pytest.mark.extended  # the suite's: test_a_data8_checkpoint_resumes_in_a_circular_pipeline, test_pipeline
def test_circular_run_equals_data_parallel_and_its_checkpoint_resumes_on_data8(tmp_path, text_data, reference):
    """stage=2,fsdp=2,model=2 circular for 2 steps (saved in layer order), resumed on data=8."""
    _, want = reference
    run_dir = tmp_path / "run"
    logs = []
    quiet(cfg_for(run_dir, text_data, steps=2, **CIRCULAR), logs)
    assert any(line.startswith("pipeline: circular over 2 stages") and "bubble 11.1%" in line for line in logs), logs
    assert any(line.startswith("lint: FSDP (fsdp) beside the stage axis") for line in logs), logs
    assert_same_run(read_metrics(run_dir), want[:2], "circular")
    quiet(cfg_for(run_dir, text_data, microbatches=None, pipeline_repeats=1), logs)
    assert any("resumed" in line and "mesh data=8" in line for line in logs), logs
    assert_same_run(read_metrics(run_dir), want, "circular -> data=8")


def test_a_data8_checkpoint_resumes_in_a_circular_pipeline(tmp_path, text_data, reference):
    """The reference's step-2 checkpoint, resumed on stage=2,fsdp=2,model=2 circular to the end."""
    ref_dir, want = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    shutil.rmtree(checkpoint_dir(run_dir) / str(STEPS))
    logs = []
    quiet(cfg_for(run_dir, text_data, **CIRCULAR), logs)
    assert any("resumed" in line and "from step 2" in line and "stage=2,fsdp=2,model=2" in line for line in logs), logs
    assert_same_run(read_metrics(run_dir), want, "data=8 -> circular")


# --------------------------------------------------------------------------------------
# bad input: one line each
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--mesh", "stage=2,data=4"], ["'stage' axis", "--microbatches", "e.g. --microbatches 4"]),
        (["--microbatches", "4"], ["--microbatches 4", "data=8", "no 'stage' axis", "stage=2,data=4"]),
        (["--pipeline-repeats", "2"], ["--pipeline-repeats 2", "--microbatches"]),
        (["--mesh", "stage=2,data=4", "--microbatches", "4", "--grad-accum", "2"], ["--grad-accum 2", "--microbatches 8"]),
        (["--mesh", "stage=4,data=2", "--microbatches", "2", "--model", "gpt2-mini"], ["2 microbatches", "4 stages"]),
        (["--mesh", "stage=2,data=4", "--microbatches", "8"], ["8 microbatches do not divide the 4 rows"]),
        (["--mesh", "stage=2,data=4", "--microbatches", "4", "--pipeline-repeats", "2"],
         ["2 layers is too shallow", "2 stages x 2 repeats"]),
        (["--model", "gpt2", "--mesh", "stage=2,data=4", "--microbatches", "4", "--pipeline-repeats", "4"],
         ["12 layers do not divide into 2 stages x 4 repeats", "1, 2, 3, 4, 6, 12"]),
        (["--microbatches", "0", "--mesh", "stage=2,data=4"], ["--microbatches", "at least 1"]),
    ],
)  # fmt: skip
def test_bad_pipeline_settings_say_what_to_do(tmp_path, text_data, capsys, extra, words):
    code, _, err = run_main(capsys, train_args(tmp_path / "run", text_data, *extra))  # gpt2-tiny: 2 layers
    assert_one_error_line(code, err, *words)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_plan_refuses_a_stage_mesh_without_microbatches(capsys):
    code, _, err = run_main(capsys, ["plan", "--model", "gpt2-mini", "--mesh", "stage=2,data=4", "--compile", "never"])
    assert_one_error_line(code, err, "--microbatches")


class _Flat(nnx.Module):
    """A model without stacked layers: nothing for pipeline stages to hold."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(256, 16, rngs=rngs)
        self.out = nnx.Linear(16, 256, rngs=rngs)

    def __call__(self, tokens):
        return self.out(self.embed(tokens))


def test_a_model_without_stacked_layers_cannot_be_pipelined(tmp_path, text_data):
    cfg = cfg_for(tmp_path / "run", text_data, model="flat", mesh="stage=2,data=4", microbatches=4)
    with pytest.raises(ConfigError) as e:
        nnxscale.train(cfg, model=_Flat, progress=False, log=lambda _: None)
    message = str(e.value)
    assert "no stacked layers" in message and "nnxscale.stack_layers" in message and "\n" not in message


# --------------------------------------------------------------------------------------
# the planner
# --------------------------------------------------------------------------------------


def test_plan_reports_the_bubble_and_the_permutes_of_pipeline_cost(text_data, capsys):
    # On stage=2,data=4 the compiled permutes are exactly the pipeline's (beside fsdp and model,
    # XLA adds permutes of its own for resharding).
    cfg = cfg_for("unused", text_data, steps=1, **{**CIRCULAR, "mesh": "stage=2,data=4"})
    step = plan(cfg)
    p = step.pipeline
    cost = pipeline_cost(Pipeline(stages=2, microbatches=4, repeats=2), 4, (16, 32, 128), batch_shards=4)
    assert (p["schedule"], p["stages"], p["repeats"], p["layers_per_stage"], p["microbatch_rows"]) == ("circular", 2, 2, 2, 1)
    assert p["bubble"] == cost.bubble == 1 / 9
    assert p["permute_bytes_per_step"] == p["permute_bytes_expected"] == cost.permute_bytes  # compiled = analytical
    assert step.collective_bytes["collective-permute"] == cost.permute_bytes
    assert step.to_dict()["pipeline"]["boundary_bytes"] == cost.boundary_bytes
    assert any("does not model the pipeline" in note for note in step.notes)
    text = str(step)
    assert "pipeline: circular, 2 stages x 2 repeats; 2 of 4 layers per stage" in text and "bubble 11.1%" in text

    estimated = plan(cfg, compile="never")  # the layout and the analytical cost without compiling
    assert estimated.pipeline["permute_bytes_per_step"] is None
    assert estimated.pipeline["permute_bytes_expected"] == cost.permute_bytes
    assert not any("bfloat16" in note for note in step.notes)

    # With bfloat16 compute the lowered permutes are bfloat16 and XLA:CPU's compiled ones
    # float32: twice the expected, which the plan says.
    half = plan(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16")))
    assert half.pipeline["permute_bytes_per_step"] == 2 * half.pipeline["permute_bytes_expected"] == cost.permute_bytes
    assert any("permutes as float32" in note for note in half.notes)
