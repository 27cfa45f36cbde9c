"""The 1F1B schedule (``--pipeline-schedule 1f1b``): the numbers of an unpipelined step, and
memory that does not grow with the microbatches.

Exactness: the real train step, pipelined with 1F1B on several meshes and remat policies
(with a document mask and a context axis, interleaved, and a mixture of experts beside an
``expert`` axis), against the same step on ``data=8`` from the same parameters: losses,
gradient norms, router losses and expert load, and updated parameters to float tolerance; and a
training run of 20 steps that moves its checkpoint to ``data=8`` and GPipe. Memory: the
compiled step's temporaries per device at 4x the microbatches (same microbatch size) do not
grow with 1F1B and do with GPipe. Then bad input, one line each.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cli import assert_one_error_line, run_main, train_args
from test_pipeline_train import assert_same_run, cfg_for, quiet

from nnxscale.errors import ConfigError
from nnxscale.layers.one_f_one_b import ring_slots
from nnxscale.layers.pipeline import Pipeline, pipeline_cost
from nnxscale.planning.compiler import measure
from nnxscale.training.config import TrainConfig
from nnxscale.training.rundir import read_metrics
from nnxscale.training.state import init_state, saved_order, setup
from nnxscale.training.step import make_train_step

SEPARATOR = 0
RESUMED = 3  # steps run after a resume in the 20-step test (each step of gpt2-mini costs ~0.7 s of CPU here)


def config(model, mesh, microbatches=None, schedule="gpipe", remat="none", documents=False, batch=16, seq=32, repeats=1,
           accum=1):  # fmt: skip
    return TrainConfig.from_flags(
        model=model, mesh=mesh, microbatches=microbatches, pipeline_schedule=schedule, remat=remat, batch_size=batch,
        seq_len=seq, min_shard_bytes=0, document_mask=documents, warmup_steps=2, min_lr_ratio=1.0, decay_steps=100,
        pipeline_repeats=repeats, grad_accum=accum,
    )  # fmt: skip


def tokens(batch, seq, documents):
    """A fixed batch of byte tokens; with ``documents`` every row holds separators (several
    documents, and the rows count different numbers of tokens)."""
    x = jax.random.randint(jax.random.key(7), (batch, seq + 1), 1, 256, jnp.int32)
    if documents:
        ends = jax.random.bernoulli(jax.random.key(8), 0.15, x.shape)
        x = jnp.where(ends, SEPARATOR, x)
    return np.asarray(x)


#: What a step reports besides the loss: a mixture's router losses and expert load.
ROUTER = ("router_aux_loss", "router_z_loss", "expert_load")


@functools.lru_cache(maxsize=None)
def run_steps(model, mesh, microbatches=None, schedule="gpipe", remat="none", documents=False, steps=3, repeats=1, accum=1):
    """Metrics of ``steps`` train steps on one fixed batch, and the parameters before and after them."""
    cfg = config(model, mesh, microbatches, schedule, remat, documents, repeats=repeats, accum=accum)
    s = setup(cfg, separator=SEPARATOR if documents else None)
    x = tokens(cfg.data.batch_size, cfg.data.seq_len, documents)
    batch = {k: jax.device_put(v, s.batch_sharding) for k, v in (("inputs", x[:, :-1]), ("targets", x[:, 1:]))}
    step, state = make_train_step(s), init_state(s)
    init = jax.tree.map(np.array, state["params"])  # copied before the first step donates them
    metrics = []
    with jax.set_mesh(s.mesh):
        for _ in range(steps):
            state, m = step(state, batch)
            metrics.append({k: np.asarray(m[k], np.float64) for k in ("loss", "grad_norm", "skipped", *ROUTER) if k in m})
    return metrics, init, jax.tree.map(np.asarray, saved_order(s, state)["params"])  # layer order


@pytest.mark.parametrize(
    "model, mesh, microbatches, remat, documents, repeats, accum",
    [
        ("gpt2-mini", "stage=2,data=4", 4, "none", False, 1, 1),
        ("gpt2-mini", "stage=4,data=2", 4, "full", False, 1, 1),  # a ring of 7 slots; each layer's input kept
        ("gpt2-mini", "stage=2,fsdp=4", 2, "dots", True, 1, 1),
        ("gpt2-mini", "stage=2,fsdp=2,model=2", 4, "none", False, 1, 1),  # FSDP and tensor parallelism in the stages
        ("llama-mini", "stage=2,context=2,data=2", 2, "full", True, 1, 1),  # ring attention inside the stages
        # interleaved: 2 groups of 1 layer per stage, every microbatch round the ring twice
        ("gpt2-mini", "stage=2,data=4", 4, "none", False, 2, 1),
        # a mixture of experts, its experts split over an expert axis inside the stages: the
        # router's losses and each expert's load are the whole batch's (here: each accumulation
        # step's, against data=8 with --grad-accum 2)
        ("mixtral-tiny", "stage=2,expert=4", 2, "none", False, 1, 2),
        ("mixtral-mini", "stage=2,expert=2,data=2", 2, "full", True, 2, 1),  # interleaved too, each layer's input kept
    ],
)  # fmt: skip
def test_1f1b_step_equals_the_data_parallel_step(model, mesh, microbatches, remat, documents, repeats, accum):
    want, init, want_params = run_steps(model, "data=8", remat=remat, documents=documents, accum=accum)
    got, _, got_params = run_steps(model, mesh, microbatches, "1f1b", remat, documents, repeats=repeats, accum=accum)
    what = f"{model} {mesh} M={microbatches} R={repeats} remat={remat} documents={documents} grad_accum={accum}"
    assert len({float(m["loss"]) for m in want}) > 1  # the steps differ (warmup starts at 0): updates are checked too
    for a, b in zip(got, want):
        assert a["skipped"] == b["skipped"] == 0
        assert a.keys() == b.keys()
        for k in ("loss", "grad_norm", *ROUTER):
            if k in b:
                np.testing.assert_allclose(a[k], b[k], rtol=1e-5, err_msg=f"{what}: {k}")
    # The parameters' change over the steps: Adam divides by the root of the second moment, so
    # last-bit differences of gradients near zero reach single parameters amplified (3e-5 of a
    # 3e-3 step seen); over all of them the updates agree to 1e-3 (a wrong gradient: order 1).
    diff = sum(np.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params)))
    update = sum(np.sum((b - i) ** 2) for b, i in zip(jax.tree.leaves(want_params), jax.tree.leaves(init)))
    assert np.sqrt(diff) <= 1e-3 * np.sqrt(update), (what, np.sqrt(diff), np.sqrt(update))


def test_1f1b_draws_dropout_per_microbatch_and_shard():
    """With dropout the schedule draws each microbatch's and shard's own masks
    (``fold_in(key, m*J + j)``): the same loss twice from the same state, another one than
    without dropout, and a finite gradient."""
    cfg = TrainConfig.from_flags(model="gpt2-mini", mesh="stage=2,data=4", microbatches=4, pipeline_schedule="1f1b",
                                 batch_size=16, seq_len=32, dropout=0.1)  # fmt: skip
    s = setup(cfg)
    x = tokens(16, 32, False)
    batch = {k: jax.device_put(v, s.batch_sharding) for k, v in (("inputs", x[:, :-1]), ("targets", x[:, 1:]))}
    step, state = make_train_step(s), init_state(s)
    twin = jax.tree.map(jnp.copy, state)  # the same state again (the step donates its argument)
    with jax.set_mesh(s.mesh):
        first = [float(v) for v in (lambda m: (m["loss"], m["grad_norm"]))(step(state, batch)[1])]
        again = [float(v) for v in (lambda m: (m["loss"], m["grad_norm"]))(step(twin, batch)[1])]
    without = run_steps("gpt2-mini", "stage=2,data=4", 4, "1f1b")[0][0]  # the first step of an exactness test's run
    assert first == again and np.all(np.isfinite(first))
    assert first[0] != without["loss"]


@pytest.mark.many_steps
def test_a_1f1b_run_of_20_steps_logs_data_parallel_losses_and_resumes_with_gpipe(tmp_path, text_data):
    """gpt2-mini, 20 steps on data=8 and with 1F1B on stage=2,data=4 (saved at 10), then the
    1F1B run's step-10 checkpoint resumed by GPipe on stage=2,data=4 and data=8's by 1F1B, for
    RESUMED steps each: the first uses the restored parameters and data position, the next ones
    the restored optimizer moments too (a resume that lost anything differs from there on)."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    # lr 1e-3: at the suite's 3e-3 this run's loss spikes at step 15 (gradient norm 91), which
    # amplifies last-bit differences of the steps before it (4.6e-7 in the gradient norm at step
    # 14 became 4.5e-5 in the loss at 15; GPipe's 7.7e-8 became 7.1e-7). Measured at 1e-3: the
    # losses of all 20 steps within 1.8e-7 of data=8, GPipe's within 2.0e-7.
    one_f_one_b = {"mesh": "stage=2,data=4", "microbatches": 4, "parallel.pipeline_schedule": "1f1b", "optim.lr": 1e-3}
    quiet(cfg_for(ref, text_data, steps=20, save_every=10, **{"optim.lr": 1e-3}))
    want = read_metrics(ref)
    logs = []
    quiet(cfg_for(run, text_data, steps=20, save_every=10, **one_f_one_b), logs)
    assert any(line.startswith("pipeline: 1F1B over 2 stages") for line in logs), logs
    assert_same_run(read_metrics(run), want, "1f1b")

    import shutil

    from nnxscale.checkpoint.checkpointer import checkpoint_dir

    end = 10 + RESUMED  # cfg_for's schedule does not depend on --steps
    shutil.rmtree(checkpoint_dir(run) / "20")
    quiet(cfg_for(run, text_data, steps=end, save_every=10, mesh="stage=2,data=4", microbatches=4, **{"optim.lr": 1e-3}),
          logs)  # fmt: skip
    assert_same_run(read_metrics(run), want[:end], "1f1b -> gpipe")
    shutil.rmtree(checkpoint_dir(ref) / "20")
    quiet(cfg_for(ref, text_data, steps=end, save_every=10, **one_f_one_b), logs)
    assert_same_run(read_metrics(ref), want[:end], "data=8 -> 1f1b")


def compiled_temp(schedule: str, microbatches: int, repeats: int = 1) -> int:
    """Temporary bytes per device of gpt2-mini's compiled step on stage=2,data=4, one row of
    64 tokens per microbatch and data shard (so the batch grows with the microbatches)."""
    cfg = TrainConfig.from_flags(model="gpt2-mini", mesh="stage=2,data=4", microbatches=microbatches,
                                 pipeline_schedule=schedule, batch_size=4 * microbatches, seq_len=64,
                                 pipeline_repeats=repeats)  # fmt: skip
    s = setup(cfg)
    with jax.set_mesh(s.mesh):
        compiled = make_train_step(s).lower(s.abstract, s.abstract_batch).compile()
    return measure(compiled)["temp_bytes"]


def test_1f1b_memory_does_not_grow_with_the_microbatches():
    """Compiled, at a fixed microbatch size: 4x the microbatches leave 1F1B's temporaries as
    they were (the ring of 2S-1 stage inputs does not depend on M) and grow GPipe's, which
    keeps every microbatch's activations for the backward pass."""
    one = {m: compiled_temp("1f1b", m) for m in (4, 16)}
    gpipe = {m: compiled_temp("gpipe", m) for m in (4, 16)}
    assert one[16] <= 1.15 * one[4], (one, gpipe)
    assert gpipe[16] >= 2 * gpipe[4], (one, gpipe)
    assert one[16] <= 0.5 * gpipe[16], (one, gpipe)
    # Interleaved (R=2): a ring of 2SR-1 = 7 items, one layer's input each, whatever M.
    interleaved = {m: compiled_temp("1f1b", m, repeats=2) for m in (4, 16)}
    assert interleaved[16] <= 1.15 * interleaved[4], (interleaved, gpipe)
    assert interleaved[16] <= 0.5 * gpipe[16], (interleaved, gpipe)


def test_the_schedule_and_its_ring():
    pipe = Pipeline.for_mesh({"stage": 4, "data": 2}, 8, schedule="1f1b")
    assert (pipe.schedule, pipe.one_f_one_b, pipe.bubble) == ("1f1b", True, 3 / 11)
    assert Pipeline.for_mesh({"stage": 4, "data": 2}, 8).schedule == "gpipe"
    assert ring_slots(4) == 7  # stage 0 holds 2(S-1)+1 microbatches' inputs
    # Interleaved: an item of repeat r waits 2S(R-1-r) + 2(S-1-s) ticks on stage s.
    assert ring_slots(2, 2) == 7 and ring_slots(4, 3) == 23
    interleaved = Pipeline(stages=2, microbatches=4, repeats=2, one_f_one_b=True)
    cost = pipeline_cost(interleaved, 4, (16, 32, 128), batch_shards=4, remat="full")
    assert (cost.in_flight, cost.held_bytes, cost.bubble) == (7, 7 * 1 * 32 * 128 * 4, 1 / 9)
    with pytest.raises(ConfigError, match="--microbatches 6"):
        Pipeline(stages=3, microbatches=4, repeats=2, one_f_one_b=True)
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'zb'"):
        Pipeline.for_mesh({"stage": 2}, 4, schedule="zb")


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--pipeline-schedule", "1f1b"], ["--pipeline-schedule 1f1b", "--microbatches"]),
        (["--mesh", "stage=2,data=4", "--microbatches", "3", "--pipeline-schedule", "1f1b", "--pipeline-repeats", "2"],
         ["interleaved 1F1B", "not a multiple of the 2 stages", "--microbatches 4"]),
        (["--mesh", "stage=2,data=4", "--microbatches", "4", "--pipeline-schedule", "zb"], ["--pipeline-schedule", "zb"]),
    ],
)  # fmt: skip
def test_bad_1f1b_settings_say_what_to_do(tmp_path, text_data, capsys, extra, words):
    code, _, err = run_main(capsys, train_args(tmp_path / "run", text_data, *extra))
    assert_one_error_line(code, err, *words)
    assert not (tmp_path / "run").exists()


def test_plan_knows_the_schedule(text_data):
    """plan on stage=4,data=2 with 1F1B: the compiled permutes are pipeline_cost's (1F1B sends
    what GPipe sends), no boundary all-reduce, and the ring of 2S-1 microbatches it holds."""
    from nnxscale.planning.report import plan

    cfg = cfg_for("unused", text_data, steps=1, mesh="stage=4,data=2", microbatches=4,
                  **{"parallel.pipeline_schedule": "1f1b"})  # fmt: skip
    step = plan(cfg)
    p = step.pipeline
    cost = pipeline_cost(Pipeline(stages=4, microbatches=4, one_f_one_b=True), 4, (16, 32, 128), batch_shards=2)
    assert (p["schedule"], p["in_flight"], p["boundary_bytes"]) == ("1f1b", 7, 0)
    assert p["held_bytes"] == cost.held_bytes == 7 * 2 * 32 * 128 * 4  # 2S-1 stage inputs of two rows each
    assert p["permute_bytes_per_step"] == p["permute_bytes_expected"] == cost.permute_bytes
    assert cost.permute_bytes == pipeline_cost(Pipeline(stages=4, microbatches=4), 4, (16, 32, 128), batch_shards=2).permute_bytes
    text = str(step)
    assert "pipeline: 1F1B, 4 stages x 1 repeats" in text and "at most 7 work items per stage" in text
