"""The 1F1B schedule (``--pipeline-schedule 1f1b``): the numbers of an unpipelined step, and
memory that does not grow with the microbatches.

Exactness: the real train step, pipelined with 1F1B on several meshes and remat policies
(with a document mask, gradient accumulation and a context axis, interleaved, a mixture
of experts beside an ``expert`` axis, and LoRA adapters), against the same step on
``data=8`` from the same parameters: losses, gradient norms, router losses and expert load,
and updated parameters to float tolerance; and a training run of 20 steps that moves its
checkpoint to ``data=8`` and GPipe. Memory: the compiled step's temporaries per device at 4x
the microbatches (same microbatch size) do not grow with 1F1B and do with GPipe, nor with
LoRA, whose stay below the full fine-tune's. Then bad input, one line each, the plan, and
the pipelines ``plan --sweep`` proposes.

CPU: every program here compiles once (``compiled_step``), and is both run and measured
where a test needs both; one step from the same parameters shows what several would (the
20-step test shows the steps that follow).
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cli import assert_one_error_line, run_main, train_args
from test_pipeline_train import assert_same_run, cfg_for, quiet

from flax import nnx

from nnxscale import make_mesh, place, resolve, use_rules
from nnxscale.errors import ConfigError
from nnxscale.layers.one_f_one_b import pipeline_value_and_grad, ring_slots
from nnxscale.layers.stack import scan_layers, stack_layers
from nnxscale.sharding.rules import logical
from nnxscale.layers.pipeline import Pipeline, pipeline_cost
from nnxscale.planning.compiler import measure
from nnxscale.sharding.mesh import format_mesh
from nnxscale.training.adapters import BASE, init_adapters, merge_params
from nnxscale.training.config import TrainConfig
from nnxscale.training.rundir import read_metrics
from nnxscale.training.state import init_state, run_order, saved_order, setup
from nnxscale.training.step import make_train_step

SEPARATOR = 0
RESUMED = 2  # steps run after a resume in the 12-step test: the second uses the restored optimizer moments


def config(model, mesh, microbatches=None, schedule="gpipe", remat="none", documents=False, repeats=1, accum=1,
           batch=16, dropout=0.0, lora=None):  # fmt: skip
    """``model`` on ``mesh``, batch x 32 tokens; no warmup (the first step updates the parameters).
    ``lora``: the rank of LoRA adapters on every linear layer of the blocks (the rest frozen)."""
    return TrainConfig.from_flags(
        model=model, mesh=mesh, microbatches=microbatches, pipeline_schedule=schedule, remat=remat, batch_size=batch,
        seq_len=32, min_shard_bytes=0, document_mask=documents, warmup_steps=0, min_lr_ratio=1.0, decay_steps=100,
        pipeline_repeats=repeats, grad_accum=accum, dropout=dropout, **({"lora_rank": lora} if lora else {}),
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


def settings(*args, **kwargs) -> tuple:
    """``config``'s arguments, every one named: one key however a test spells them."""
    bound = inspect.signature(config).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.items())


def compiled_step(*args, **kwargs):
    """``(setup, compiled train step)`` of ``config(*args, **kwargs)``: each program compiled
    once in this file, run by the exactness tests and measured by the memory test."""
    return _compiled(settings(*args, **kwargs))


@functools.lru_cache(maxsize=None)
def _compiled(named: tuple):
    cfg = config(**dict(named))
    s = setup(cfg, separator=SEPARATOR if cfg.data.document_mask else None)
    with jax.set_mesh(s.mesh):
        return s, make_train_step(s).lower(s.abstract, s.abstract_batch).compile()


@functools.lru_cache(maxsize=None)
def initial_params(model):
    """``model``'s parameters as the data=8 run creates them (layer order, numpy)."""
    return jax.tree.map(np.array, init_state(setup(config(model, "data=8")))["params"])


@functools.lru_cache(maxsize=None)
def initial_adapters(model, rank):
    """LoRA adapters of ``rank`` for ``model`` (numpy, layer order): ``A`` as drawn, ``B`` not
    zero (fresh adapters have ``B = 0``, and so no gradient of ``A``: both must be tested)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(init_adapters(setup(config(model, "data=8", lora=rank))))
    drawn = [0.05 * jax.random.normal(jax.random.key(i), a.shape, a.dtype) if kp[-1].key == "b" else a
             for i, (kp, a) in enumerate(flat)]  # fmt: skip
    return jax.tree.unflatten(treedef, [np.asarray(a) for a in drawn])


def start_params(model, lora=None):
    """What one step starts from: ``initial_params`` (the frozen base under LoRA) and the adapters."""
    base = initial_params(model)
    return base if not lora else merge_params(base, initial_adapters(model, lora))


def run_step(*args, **kwargs):
    """Metrics of one train step of ``config(*args, **kwargs)`` from ``start_params`` on one
    fixed batch, and the trained parameters after it (layer order). Under LoRA the metrics
    count the base's leaves that changed (``base_changed``)."""
    s, step = compiled_step(*args, **kwargs)
    cfg, lora = s.cfg, s.model.lora is not None
    x = tokens(cfg.data.batch_size, cfg.data.seq_len, cfg.data.document_mask)
    batch = {k: jax.device_put(v, s.batch_sharding) for k, v in (("inputs", x[:, :-1]), ("targets", x[:, 1:]))}
    if not lora:
        state = init_state(s, jax.device_put(initial_params(cfg.model.name), s.state_shardings["params"]))
    else:  # the given adapters (init_state would draw fresh ones) beside the base
        start = start_params(cfg.model.name, cfg.lora.rank)
        with jax.set_mesh(s.mesh):
            state = run_order(s, jax.jit(s.init_fn, out_shardings=s.state_shardings)(start))
    with jax.set_mesh(s.mesh):
        state, m = step(state, batch)
    metrics = {k: np.asarray(m[k], np.float64) for k in ("loss", "grad_norm", "skipped", *ROUTER) if k in m}
    after = saved_order(s, state)
    if lora:
        same = jax.tree.map(np.array_equal, jax.device_get(after[BASE]), initial_params(cfg.model.name))
        metrics["base_changed"] = sum(not v for v in jax.tree.leaves(same))
    return metrics, jax.tree.map(np.asarray, after["params"])


@functools.lru_cache(maxsize=None)
def _run_once(named: tuple):
    return run_step(**dict(named))


def run_steps(*args, **kwargs):
    """``run_step``, run once per configuration in this file."""
    return _run_once(settings(*args, **kwargs))


@pytest.mark.parametrize(
    "model, mesh, microbatches, remat, documents, repeats, accum, lora",
    [
        ("gpt2-mini", "stage=2,data=4", 4, "none", True, 1, 1, None),
        # a ring of 7 slots, each layer's input kept; each accumulation step a 1F1B pass
        pytest.param("gpt2-mini", "stage=4,data=2", 4, "full", True, 1, 2, None, marks=pytest.mark.extended),
        pytest.param("gpt2-mini", "stage=2,fsdp=2,model=2", 2, "dots", True, 1, 1, None, marks=pytest.mark.extended),  # FSDP and tensor parallelism in the stages
        # interleaved: 2 groups of 1 layer per stage, every microbatch round the ring twice
        ("gpt2-mini", "stage=2,data=4", 4, "none", True, 2, 1, None),
        pytest.param("llama-mini", "stage=2,context=2,data=2", 2, "full", True, 1, 1, None, marks=pytest.mark.extended),  # ring attention inside the stages
        # a mixture of experts, its experts split over an expert axis inside the stages,
        # interleaved, each layer's input kept: the router's losses and each expert's load are
        # the whole batch's
        pytest.param("mixtral-mini", "stage=2,expert=2,data=2", 2, "full", True, 2, 1, None, marks=pytest.mark.extended),
        # LoRA: only the adapters differentiated (against data=8 with LoRA), the frozen base
        # closed over, each layer's input kept (the program test_1f1b_with_lora_... measures)
        ("gpt2-mini", "stage=2,data=4", 2, "full", True, 1, 1, 4),
    ],
)  # fmt: skip
def test_1f1b_step_equals_the_data_parallel_step(model, mesh, microbatches, remat, documents, repeats, accum, lora):
    """One step from the same parameters on the same batch, against data=8's (no remat, no
    accumulation: both are the same step's numbers): the loss, its gradient's norm, a
    mixture's router losses and expert load, and the updated parameters (the first step
    updates them at the full learning rate); under LoRA the adapters, and the base unchanged."""
    want, want_params = run_steps(model, "data=8", documents=documents, lora=lora)
    got, got_params = run_steps(model, mesh, microbatches, "1f1b", remat, documents, repeats=repeats, accum=accum,
                                lora=lora)  # fmt: skip
    what = f"{model} {mesh} M={microbatches} R={repeats} remat={remat} documents={documents} grad_accum={accum} lora={lora}"
    assert got["skipped"] == want["skipped"] == 0
    assert got.get("base_changed", 0) == want.get("base_changed", 0) == 0, what
    assert got.keys() == want.keys()
    for k in ("loss", "grad_norm", *ROUTER):
        if k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=f"{what}: {k}")
    # The parameters' change: Adam divides by the root of the second moment, so last-bit
    # differences of gradients near zero reach single parameters amplified (3e-5 of a 3e-3
    # step seen); over all of them the updates agree to 1e-3 (a wrong gradient: order 1).
    init = initial_adapters(model, lora) if lora else initial_params(model)
    diff = sum(np.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params)))
    update = sum(np.sum((b - i) ** 2) for b, i in zip(jax.tree.leaves(want_params), jax.tree.leaves(init)))
    assert update > 0, what
    assert np.sqrt(diff) <= 1e-3 * np.sqrt(update), (what, np.sqrt(diff), np.sqrt(update))


def test_1f1b_draws_dropout_per_microbatch_and_shard():
    """With dropout the schedule draws each microbatch's and shard's own masks
    (``fold_in(key, m*J + j)``): the same loss twice from the same state, another one than
    without dropout (data=8's, which 1F1B's equals: the test above), and a finite gradient."""
    first, _ = run_step("gpt2-mini", "stage=2,data=4", 4, "1f1b", documents=True, dropout=0.1)
    again, _ = run_step("gpt2-mini", "stage=2,data=4", 4, "1f1b", documents=True, dropout=0.1)
    without = run_steps("gpt2-mini", "data=8", documents=True)[0]
    assert (first["loss"], first["grad_norm"]) == (again["loss"], again["grad_norm"])
    assert np.isfinite(first["loss"]) and np.isfinite(first["grad_norm"])
    assert abs(first["loss"] - without["loss"]) > 1e-3 * without["loss"]


@pytest.mark.many_steps
def test_a_1f1b_run_of_12_steps_logs_data_parallel_losses_and_resumes_with_gpipe(tmp_path, text_data):
    """gpt2-mini, 12 steps on data=8 and with 1F1B on stage=2,data=4 (saved at 6), then the
    1F1B run's step-6 checkpoint resumed by GPipe on stage=2,data=4 and data=8's by 1F1B, for
    RESUMED steps each: the first uses the restored parameters and data position, the second
    the restored optimizer moments too (a resume that lost anything differs from there on).
    Batch 8 x 32 in 2 microbatches of one row per data shard (the exactness tests above
    cover more microbatches): the steps' CPU time is most of this test's."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    # lr 1e-3: at the suite's 3e-3 the run's loss spikes (gradient norm 92 at step 16 with a
    # batch of 16), which amplifies last-bit differences of the steps before it: from the
    # spike on, fsdp=8 (no pipeline) differs from data=8 by 5.6e-5 in the loss, GPipe by
    # 1.3e-5 and 1F1B by 7.8e-6 (python bench/pipeline_spike.py, docs/pipelines.md): the run's
    # chaos, not the schedule's.
    small = {"data.batch_size": 8, "optim.lr": 1e-3}
    one_f_one_b = {"mesh": "stage=2,data=4", "microbatches": 2, "parallel.pipeline_schedule": "1f1b", **small}
    quiet(cfg_for(ref, text_data, steps=12, save_every=6, **small))
    want = read_metrics(ref)
    logs = []
    quiet(cfg_for(run, text_data, steps=12, save_every=6, **one_f_one_b), logs)
    assert any(line.startswith("pipeline: 1F1B over 2 stages") for line in logs), logs
    assert_same_run(read_metrics(run), want, "1f1b")

    import shutil

    from nnxscale.checkpoint.checkpointer import checkpoint_dir

    end = 6 + RESUMED  # cfg_for's schedule does not depend on --steps
    shutil.rmtree(checkpoint_dir(run) / "12")
    quiet(cfg_for(run, text_data, steps=end, save_every=6, mesh="stage=2,data=4", microbatches=2, **small), logs)
    assert_same_run(read_metrics(run), want[:end], "1f1b -> gpipe")
    shutil.rmtree(checkpoint_dir(ref) / "12")
    quiet(cfg_for(ref, text_data, steps=end, save_every=6, **one_f_one_b), logs)
    assert_same_run(read_metrics(ref), want[:end], "data=8 -> 1f1b")


def compiled_temp(schedule: str, microbatches: int, repeats: int = 1) -> int:
    """Temporary bytes per device of gpt2-mini's compiled step on stage=2,data=4, one row of
    32 tokens per microbatch and data shard (so the batch grows with the microbatches); at
    M=4 the programs the exactness tests run."""
    _, compiled = compiled_step("gpt2-mini", "stage=2,data=4", microbatches, schedule, documents=True, repeats=repeats,
                                batch=4 * microbatches)  # fmt: skip
    return measure(compiled)["temp_bytes"]


def test_1f1b_memory_does_not_grow_with_the_microbatches():
    """Compiled, at a fixed microbatch size: 4x the microbatches leave 1F1B's temporaries as
    they were (the ring of 2S-1 stage inputs does not depend on M) and grow GPipe's, which
    keeps every microbatch's activations for the backward pass: per added microbatch at
    least 8 of the (T, C) widths each of the stage's 2 layers keeps (``none`` keeps about 10:
    test_gpt2's test of remat none)."""
    one = {m: compiled_temp("1f1b", m) for m in (4, 16)}
    gpipe = {m: compiled_temp("gpipe", m) for m in (4, 16)}
    width = 32 * 128 * 4  # a microbatch's row of 32 tokens, 128 wide, float32, on a device
    assert one[16] <= 1.15 * one[4], (one, gpipe)
    assert gpipe[16] - gpipe[4] >= 12 * 2 * 8 * width, (one, gpipe)
    assert one[16] <= 0.75 * gpipe[16], (one, gpipe)
    # Interleaved (R=2): a ring of 2SR-1 = 7 items, one layer's input each, whatever M.
    interleaved = {m: compiled_temp("1f1b", m, repeats=2) for m in (4, 16)}
    assert interleaved[16] <= 1.15 * interleaved[4], (interleaved, gpipe)
    assert interleaved[16] <= 0.75 * gpipe[16], (interleaved, gpipe)


def test_1f1b_with_lora_keeps_no_base_weights_in_its_ring():
    """LoRA under 1F1B with remat full (the ring keeps each layer's input; a pullback over the
    adapters that kept the frozen base as a residual would keep 2S-1 copies of the stage's
    weights there), compiled: temporaries per device no larger than the full fine-tune's of
    the same step, and 4x the microbatches (same size) leave them as they were."""

    def temp(microbatches, lora):  # M=2: the program the LoRA exactness case runs
        _, compiled = compiled_step("gpt2-mini", "stage=2,data=4", microbatches, "1f1b", "full", True,
                                    batch=8 * microbatches, lora=lora)  # fmt: skip
        return measure(compiled)["temp_bytes"]

    lora = {m: temp(m, 4) for m in (2, 8)}
    full = temp(2, None)
    assert lora[2] <= full, (lora, full)
    assert lora[8] <= 1.15 * lora[2], (lora, full)


class _Sandwich(nnx.Module):
    """An embedding, two layers outside the pipeline (``pipelined=False``: 1F1B's prefix runs
    them), four pipelined, one outside again (the tail's), a head: DeepSeek's dense first
    layers and Gemma 3's last layers around the stack the stages split, in miniature."""

    def __init__(self, rngs, D=16, V=256):
        normal = nnx.initializers.normal(0.3)
        self.embed = nnx.Embed(V, D, rngs=rngs)

        def block(r):
            norm = nnx.LayerNorm(D, scale_init=logical(nnx.initializers.ones_init(), "embed"), use_bias=False, rngs=r)
            return nnx.Sequential(norm, nnx.Linear(D, D, kernel_init=logical(normal, "embed", "mlp"), use_bias=False, rngs=r))

        self.first = stack_layers(block, 2, rngs=rngs, pipelined=False)
        self.body = stack_layers(block, 4, rngs=rngs)
        self.last = stack_layers(block, 1, rngs=rngs, pipelined=False)
        self.head = nnx.Linear(D, V, rngs=rngs)

    def loss(self, inputs, targets, *, rngs=None):
        x = self.embed(inputs)
        for stack in (self.first, self.body, self.last):
            x = scan_layers(stack, x)  # each layer: x + f(x) would be the residual; f(x) is enough here
        logits = self.head(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))


def test_1f1b_runs_the_stacks_outside_the_pipeline_in_its_prefix_and_tail():
    """Loss and gradients (the outer stacks' among them) of 1F1B on stage=2,data=4 equal
    ``jax.value_and_grad`` of the unpipelined loss; the outer stacks stay whole on every device."""
    mesh = make_mesh("stage=2,data=4")
    rules = resolve("auto", mesh, min_shard_bytes=0)
    graphdef, params = nnx.split(place(_Sandwich(nnx.Rngs(0)), mesh, rules))
    held = {name: {s.data.shape[0] for v in jax.tree.leaves(params[name]) for s in v.addressable_shards}
            for name in ("first", "body", "last")}  # fmt: skip
    assert held == {"first": {2}, "body": {2}, "last": {1}}
    x = tokens(16, 8, False)
    inputs, targets = jnp.asarray(x[:, :-1]), jnp.asarray(x[:, 1:])
    objective = lambda model, i, t, rngs=None: model.loss(i, t)  # noqa: E731

    def unpipelined(p):
        with use_rules(rules):
            return objective(nnx.merge(graphdef, p), inputs, targets)

    def pipelined(p):
        with use_rules(rules):
            return pipeline_value_and_grad(objective, graphdef, p, inputs, targets, None,
                                           pipeline=Pipeline.for_mesh(mesh, 4, schedule="1f1b"), mesh=mesh)  # fmt: skip

    want, want_grads = jax.jit(jax.value_and_grad(unpipelined))(params)
    (got, _), got_grads = jax.jit(pipelined)(params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for name in ("embed", "first", "body", "last", "head"):
        for g, w in zip(jax.tree.leaves(got_grads[name]), jax.tree.leaves(want_grads[name])):
            assert float(jnp.max(jnp.abs(w))) > 0, name
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(w))), err_msg=name)


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


@pytest.mark.parametrize("lora", [None, pytest.param(4, marks=pytest.mark.extended)])
def test_plan_knows_the_schedule(text_data, lora):
    """plan on stage=4,data=2 with 1F1B: the compiled permutes are pipeline_cost's (1F1B sends
    what GPipe sends), no boundary all-reduce, and the ring of 2S-1 microbatches it holds;
    with LoRA adapters (the base frozen) the same."""
    from nnxscale.planning.report import plan

    cfg = cfg_for("unused", text_data, steps=1, mesh="stage=4,data=2", microbatches=4,
                  **{"parallel.pipeline_schedule": "1f1b", **({"lora.rank": lora} if lora else {})})  # fmt: skip
    step = plan(cfg)
    assert (step.gradient_bytes < step.param_bytes / 4) == bool(lora)  # under LoRA the adapters' gradients only
    p = step.pipeline
    cost = pipeline_cost(Pipeline(stages=4, microbatches=4, one_f_one_b=True), 4, (16, 32, 128), batch_shards=2)
    assert (p["schedule"], p["in_flight"], p["boundary_bytes"]) == ("1f1b", 7, 0)
    assert p["held_bytes"] == cost.held_bytes == 7 * 2 * 32 * 128 * 4  # 2S-1 stage inputs of two rows each
    assert p["permute_bytes_per_step"] == p["permute_bytes_expected"] == cost.permute_bytes
    assert cost.permute_bytes == pipeline_cost(Pipeline(stages=4, microbatches=4), 4, (16, 32, 128), batch_shards=2).permute_bytes
    text = str(step)
    assert "pipeline: 1F1B, 4 stages x 1 repeats" in text and "at most 7 work items per stage" in text


def test_the_sweep_tries_each_schedule_and_microbatch_count():
    """Stage meshes that divide the devices and the layers, both schedules, and the
    microbatch counts S, 2S, 4S, 8S that divide a batch shard's rows; the proxy time: the
    bubble's share of the compute, one forward more for 1F1B without remat, and a cost per
    iteration, so a large step wants many microbatches and a tiny one few."""
    from nnxscale.planning import meshes

    got = meshes.pipeline_candidates(8, 4, 16)  # 4 layers: 2 or 4 stages; 16 rows over 4 or 2 shards
    for stages, rows in ((2, 4), (4, 8)):
        for split in ("data", "fsdp"):
            mesh = f"stage={stages},{split}={8 // stages}"
            for schedule in ("gpipe", "1f1b"):
                want = [m for m in (stages, 2 * stages, 4 * stages, 8 * stages) if rows % m == 0]
                assert [m for g, s, m in got if (g, s) == (mesh, schedule)] == want, (mesh, got)
    assert not any(g.startswith("stage=8") for g, _, _ in got)  # 8 stages do not divide 4 layers
    # --grad-accum 2: 8 rows a step, 2 per shard on 4 shards, 4 on 2: one microbatch per stage
    assert meshes.pipeline_candidates(8, 4, 16, grad_accum=2) == [
        (g, s, m) for g, s, m in got if m == (2 if g.startswith("stage=2") else 4)]  # fmt: skip
    assert meshes.pipeline_candidates(8, 4, 16, grad_accum=4) == []  # 1 row per shard: fewer than the stages

    def proxy(flops, schedule, m, remat="full", stages=4, repeats=1):
        return meshes.pipeline_proxy_seconds(flops, {"schedule": schedule, "stages": stages, "repeats": repeats,
                                                     "microbatches": m}, remat)  # fmt: skip

    per_iteration = meshes.PROXY_SECONDS_PER_ITERATION
    compute = 1e12 / meshes.PROXY_FLOPS_PER_SECOND
    assert proxy(1e12, "gpipe", 8) == pytest.approx(compute * 11 / 8 + 11 * per_iteration)
    assert proxy(1e12, "1f1b", 8, remat="none") == pytest.approx(compute * 4 / 3 * 11 / 8 + 11 * per_iteration)
    assert proxy(1e12, "1f1b", 8, repeats=2) == pytest.approx(compute * 19 / 16 + 19 * per_iteration)
    big, tiny = 1e15, 1e6
    assert min((4, 8, 16, 32), key=lambda m: proxy(big, "1f1b", m)) == 32
    assert min((4, 8, 16, 32), key=lambda m: proxy(tiny, "1f1b", m)) == 4


def test_the_sweep_proposes_1f1b_where_gpipe_does_not_fit():
    """``plan --sweep`` plans the pipelines (estimated: the activations each schedule keeps)
    and proposes, within the device memory, the one with the least proxy time: with memory
    for 1F1B's peak but below GPipe's at any M (remat none) that is 1F1B, at a microbatch
    count that divides the rows; each pipeline is listed with its schedule, M, bubble and
    peak."""
    from nnxscale.planning import meshes

    cfg = TrainConfig.from_flags(model="gpt2-tiny", mesh="data=8", batch_size=16, seq_len=64)
    plans, skipped = meshes.pipeline_plans(cfg, 8, 2, remats=("none",))
    assert not skipped
    peak = {(format_mesh(p.mesh), p.pipeline["schedule"]): p.peak_bytes for p in plans}
    assert {k[1] for k in peak} == {"gpipe", "1f1b"}
    one, gpipe = peak[("stage=2,data=4", "1f1b")], peak[("stage=2,data=4", "gpipe")]
    assert one < gpipe  # the ring of 2S-1 stage inputs against every microbatch's activations
    plans, _ = meshes.sweep(cfg, 8, remats=("none",), device_memory=one)
    chosen = meshes.proposed_pipeline(plans)
    assert chosen.pipeline["schedule"] == "1f1b" and chosen.fits
    assert (16 // 4) % chosen.pipeline["microbatches"] == 0
    assert all(not p.fits for p in plans if p.pipeline is not None and p.pipeline["schedule"] == "gpipe")
    table = meshes.sweep_table(plans)
    proposed = [line for line in table.splitlines() if line.endswith("<- proposed")]
    assert len(proposed) == 1 and "1f1b" in proposed[0] and f"M={chosen.pipeline['microbatches']}" in proposed[0], table


def test_compiled_pipelines_are_ranked_by_their_predicted_step_time(monkeypatch):
    """Where the sweep compiles (here ``compile="always"``; ``--target`` alike), each mesh,
    schedule and remat policy compiles only the microbatch counts with the least proxy time
    (meshes.PIPELINE_COMPILES_PER_GROUP of them), then chooses among them, and proposes among
    all, by the predicted step time, not the proxy. The compile is stood in for: the estimate
    given a step time that prefers what the proxy does not."""
    import dataclasses
    from types import SimpleNamespace

    from nnxscale.planning import meshes

    real_plan, compiled, cache = meshes.plan, [], {}

    def fake_plan(c, *, compile, **kw):
        key = (c.parallel.mesh, c.parallel.pipeline_schedule, c.parallel.microbatches)
        if key not in cache:  # each estimate once: the sweep is planned twice here
            cache[key] = real_plan(c, compile="never", **kw)
        p = dataclasses.replace(cache[key])
        if compile == "never":
            return p
        m = c.parallel.microbatches
        compiled.append((c.parallel.mesh, c.parallel.pipeline_schedule, m))
        seconds = 1.0 / m + (0.5 if c.parallel.pipeline_schedule == "gpipe" else 0.0)  # 1f1b at the larger M fastest
        return dataclasses.replace(p, step_time=SimpleNamespace(seconds=seconds))

    monkeypatch.setattr(meshes, "plan", fake_plan)
    cfg = TrainConfig.from_flags(model="gpt2-tiny", mesh="data=8", batch_size=32, seq_len=64)  # M = 2, 4, 8
    estimated, _ = meshes.pipeline_plans(cfg, 8, 2, remats=("none",))  # no compile: the proxy's choice
    assert not compiled and all(p.step_time is None for p in estimated)
    proxy_m = {(format_mesh(p.mesh), p.pipeline["schedule"]): p.pipeline["microbatches"] for p in estimated}
    plans, _ = meshes.pipeline_plans(cfg, 8, 2, remats=("none",), compile="always")
    k = meshes.PIPELINE_COMPILES_PER_GROUP
    assert len(compiled) == k * len(proxy_m) and len(plans) == len(proxy_m)
    for p in plans:
        key = (format_mesh(p.mesh), p.pipeline["schedule"])
        tried = sorted(m for mesh, schedule, m in compiled if (mesh, schedule) == key)
        assert len(tried) == k and proxy_m[key] in tried  # the proxy's best is among those compiled
        assert p.pipeline["microbatches"] == max(tried) != proxy_m[key]  # the prediction chose, not the proxy
        assert p.step_time.seconds == min(1.0 / m for m in tried) + (0.5 if key[1] == "gpipe" else 0.0)
    chosen = meshes.proposed_pipeline(plans)
    assert chosen.pipeline["schedule"] == "1f1b" and chosen.step_time.seconds == min(p.step_time.seconds for p in plans)
    # one with a prediction ranks before one with a smaller proxy time and none
    faster_by_proxy = dataclasses.replace(chosen, step_time=None, pipeline={**chosen.pipeline, "proxy_seconds": 0.0})
    assert meshes.proposed_pipeline([faster_by_proxy, *plans]) is chosen
    lines = meshes.pipeline_lines(plans)
    assert "ranked by predicted step time" in lines[1] and lines[2].endswith("<- proposed"), lines
