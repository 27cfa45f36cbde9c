"""Training: what a user relies on. Exact resume after SIGTERM, resume onto another mesh,
the same numbers on every mesh, optimizer state laid out like the parameters, gradient
accumulation, the run directory's records, --init-from, and sampling.

Every run is the byte-level ``gpt2-tiny`` on a ~280 KB text file, batch 16 x 32 tokens,
a few steps: compilation dominates, so tests share runs where they can.
"""

import dataclasses
import functools
import json
import math
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nnxscale.training.loop as train_mod
from nnxscale.cli import commands as cli
from nnxscale.errors import DonatedStateError
from nnxscale.data import tokens as datalib
from nnxscale.checkpoint.checkpointer import checkpoint_dir
from nnxscale.training.config import FLAT_NAMES, TrainConfig, with_overrides
from nnxscale.training.sampling import sample
from nnxscale.models import gpt2
from nnxscale.training.loop import train
from nnxscale.training.rundir import read_metrics
from nnxscale.training.state import init_state, setup
from nnxscale.training.step import make_train_step

# The learning-rate schedule below does not depend on --steps (2 warmup steps, then a
# constant peak), so runs of different lengths share their first steps exactly. With the
# default warmup + cosine the schedule is stretched to each run's --steps.
PINNED_SCHEDULE = {"optim.warmup_steps": 2, "optim.min_lr_ratio": 1.0}
REF_STEPS = 6


# --------------------------------------------------------------------------------------
# helpers and shared runs
# --------------------------------------------------------------------------------------


def tiny_cfg(run_dir, data, **overrides) -> TrainConfig:
    """gpt2-tiny on data=8, batch 16 x 32, pinned schedule; dotted keys override fields.

    gpt2-tiny's tensors are kilobytes, so the FSDP minimum size is off: FSDP meshes split them.
    """
    fields = {
        "model": "gpt2-tiny",
        "mesh": "data=8",
        "min_shard_bytes": 0,
        "steps": REF_STEPS,
        "log_every": 1,
        "eval_every": 0,
        "save_every": 0,
        "run_dir": str(run_dir),
        "data.data": str(data),
        "data.seq_len": 32,
        "data.batch_size": 16,
        **PINNED_SCHEDULE,
    }
    fields.update({k.replace("__", "."): v for k, v in overrides.items()})
    return with_overrides(TrainConfig(), {FLAT_NAMES.get(k, k): v for k, v in fields.items()})


def quiet_train(cfg, log=None):
    return train(cfg, progress=False, log=log if log is not None else (lambda _: None))


@pytest.fixture(scope="module")
def ref_run(tmp_path_factory, text_data):
    """The uninterrupted reference: seed 0, data=8, REF_STEPS steps, every step logged."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    result = quiet_train(tiny_cfg(run_dir, text_data))
    assert result.final_step == REF_STEPS and result.interrupted_by is None
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, REF_STEPS + 1))
    return run_dir, records


class _Captured(Exception):
    pass


@dataclasses.dataclass(eq=False)
class Seen:
    """One parameter as the first step received it (a pytree leaf: not a registered node)."""

    sharding: jax.sharding.Sharding
    shard_shape: tuple
    value: np.ndarray


def capture_first_state(monkeypatch, stop: bool = False) -> dict:
    """Record the train state ``train()`` hands to its first step (then go on, or stop).

    Fills ``seen["params"]`` with a :class:`Seen` per parameter and ``seen["opt_state"]``
    with the optimizer state's shardings. ``stop``: raise :class:`_Captured` instead of
    stepping (no step is compiled).
    """
    seen = {}
    real = train_mod.make_train_step

    def make(s):
        step = real(s)

        def first(state, batch):
            if "params" not in seen:
                describe = lambda a: Seen(a.sharding, a.addressable_shards[0].data.shape, np.asarray(a))  # noqa: E731
                seen["params"] = jax.tree.map(describe, state["params"])
                seen["opt_state"] = jax.tree.map(lambda a: a.sharding, state["opt_state"])
                if stop:
                    raise _Captured
            return step(state, batch)

        return first

    monkeypatch.setattr(train_mod, "make_train_step", make)
    return seen


def flat(tree) -> dict:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def captured_values(seen) -> dict:
    return {k: v.value for k, v in flat(seen["params"]).items()}


def host_params(state) -> dict:
    return {k: np.asarray(v) for k, v in flat(jax.device_get(state["params"])).items()}


def assert_params_equal(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@functools.lru_cache(maxsize=None)  # two tests compare against seed 0's: one setup and init for both
def fresh_params(data, seed: int) -> dict:
    """The parameters a fresh run with ``seed`` starts from (host arrays: callers only read them)."""
    s = setup(tiny_cfg("unused", data, seed=seed))
    return host_params(init_state(s))


def fixed_batch(data, sharding, batch=16, seq=32):
    tokens = np.frombuffer(data.read_bytes(), np.uint8)[: batch * (seq + 1)].astype(np.int32)
    rows = tokens.reshape(batch, seq + 1)
    return datalib.to_global({"inputs": rows[:, :-1].copy(), "targets": rows[:, 1:].copy()}, sharding)


# --------------------------------------------------------------------------------------
# 1. resume after SIGTERM is exact
# --------------------------------------------------------------------------------------


def _metrics_so_far(path):
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return out


@pytest.mark.many_steps
def test_resume_after_sigterm_equals_an_uninterrupted_run(tmp_path, text_data):
    # ~30 steps (at -O1, about 0.05 s each) cannot run in the moment between poll and signal
    steps, signal_after = 30, 3

    def command(run_dir):
        return [
            sys.executable, "-m", "nnxscale", "train", "--model", "gpt2-tiny", "--mesh", "data=8",
            "--batch-size", "16", "--seq-len", "32", "--steps", str(steps), "--eval-every", "12",
            "--data", str(text_data), "--run-dir", str(run_dir), "--log-every", "1", "--no-progress",
        ]  # fmt: skip

    env = {k: v for k, v in os.environ.items() if k != "NNXSCALE_DEBUG"}
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    whole_dir, cut_dir = tmp_path / "whole", tmp_path / "cut"
    # The uninterrupted run starts once the interrupted one has compiled the programs both
    # run: it loads them from the suite's compilation cache instead of compiling them again.
    cut = subprocess.Popen(command(cut_dir), **popen)
    resumed = None
    try:
        deadline = time.monotonic() + 400
        while True:
            records = _metrics_so_far(cut_dir / "metrics.jsonl")
            if records and records[-1]["step"] >= signal_after:
                break
            assert cut.poll() is None, f"run ended before the signal: {cut.communicate()}"
            assert time.monotonic() < deadline, "no metrics within the time limit"
            time.sleep(0.02)
        cut.send_signal(signal.SIGTERM)
        out, err = cut.communicate(timeout=300)
        assert cut.returncode == 128 + signal.SIGTERM, err

        records = read_metrics(cut_dir)
        stopped = records[-1]["step"]
        assert signal_after <= stopped < steps  # the interruption happened
        assert f"stopped by SIGTERM at step {stopped}" in out
        ckpt_root = checkpoint_dir(cut_dir)
        assert sorted(p.name for p in ckpt_root.iterdir()) == [str(stopped)]
        assert (ckpt_root / str(stopped) / "commit_success.txt").exists()

        # The resumed run in a process of its own, the uninterrupted one meanwhile in this
        # process, with the same command and environment: the same programs, from the cache.
        resumed = subprocess.Popen(command(cut_dir), **popen)
        assert cli.main(command(whole_dir)[3:]) == 0
        out, err = resumed.communicate(timeout=400)
        assert resumed.returncode == 0, err
        assert f"from step {stopped}" in out
    finally:
        for p in (resumed, cut):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()

    got, want = read_metrics(cut_dir), read_metrics(whole_dir)
    assert [r["step"] for r in got] == list(range(1, steps + 1))  # each step once, none lost
    assert [r["step"] for r in want] == list(range(1, steps + 1))
    for a, b in zip(got, want):
        for key in ("loss", "grad_norm", "lr"):
            assert a[key] == b[key], f"step {a['step']} {key}: {a[key]} resumed (from step {stopped}), {b[key]} whole"
        assert a.get("val_loss") == b.get("val_loss"), f"step {a['step']} val_loss, resumed from step {stopped}"
    assert [r["step"] for r in got if "val_loss" in r] == [12, 24, 30]


# --------------------------------------------------------------------------------------
# 2. restore onto another mesh; 3. the same numbers on every mesh
# --------------------------------------------------------------------------------------


def test_resume_on_another_mesh_continues_the_run(tmp_path, text_data, ref_run, monkeypatch):
    _, want = ref_run
    run_dir = tmp_path / "run"
    first = quiet_train(tiny_cfg(run_dir, text_data, steps=3))
    assert first.final_step == 3
    assert sorted(p.name for p in checkpoint_dir(run_dir).iterdir()) == ["3"]

    seen = capture_first_state(monkeypatch)
    logs = []
    result = quiet_train(tiny_cfg(run_dir, text_data, steps=REF_STEPS, mesh="data=2,model=4"), log=logs.append)
    assert result.start_step == 3 and result.final_step == REF_STEPS
    assert any("resumed" in line and "data=2,model=4" in line for line in logs), logs

    got = read_metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, REF_STEPS + 1))
    for a, b in zip(got, want):
        assert a["lr"] == b["lr"], a["step"]
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5, err_msg=f"step {a['step']}")
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-4, err_msg=f"step {a['step']}")

    # The restored state lives on the new mesh, in the new layout (mlp, heads, vocab over model).
    params = flat(seen["params"])
    expected_shards = {
        "['h']['mlp']['c_fc']['kernel']": (2, 64, 64),  # (2 layers, 64, 256) split on mlp
        "['h']['mlp']['c_proj']['kernel']": (2, 64, 64),  # (2, 256, 64) split on mlp
        "['h']['attn']['c_attn']['kernel']": (2, 64, 3, 2, 8),  # (2, 64, 3, 8, 8) split on heads
        "['wte']['embedding']": (64, 64),  # (256, 64) split on vocab
    }
    for name, shard in expected_shards.items():
        assert params[name].shard_shape == shard, name
    for name, p in params.items():
        assert dict(p.sharding.mesh.shape) == {"data": 2, "model": 4}, name
    for sharding in jax.tree.leaves(seen["opt_state"]):
        assert dict(sharding.mesh.shape) == {"data": 2, "model": 4}


@pytest.mark.parametrize("mesh", ["fsdp=8", "model=8", "data=2,model=4"])
def test_same_losses_on_every_mesh(tmp_path, text_data, ref_run, mesh, rules_built):
    _, want = ref_run  # data=8
    steps = 3
    quiet_train(tiny_cfg(tmp_path / "run", text_data, steps=steps, mesh=mesh))
    assert len(rules_built) == 1  # resolved at setup; the lint, the state layouts and the step ask that one
    got = read_metrics(tmp_path / "run")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert len({r["loss"] for r in got}) == steps  # the model does learn: the steps differ
    for a, b in zip(got, want):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5, err_msg=f"{mesh} step {a['step']}")
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-4, err_msg=f"{mesh} step {a['step']}")


# --------------------------------------------------------------------------------------
# 4. optimizer state sharded like the parameters
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh", ["fsdp=8", "data=2,model=4"])
def test_optimizer_state_is_sharded_like_the_parameters(text_data, mesh):
    s = setup(tiny_cfg("unused", text_data, mesh=mesh))
    state = init_state(s)
    params = state["params"]
    param_leaves = jax.tree_util.tree_leaves_with_path(params)
    # The layout is not trivially replicated on these meshes.
    assert any(p.addressable_shards[0].data.shape != p.shape for _, p in param_leaves)

    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    adam = [x for x in jax.tree.leaves(state["opt_state"], is_leaf=is_adam) if is_adam(x)]
    assert len(adam) == 1
    moment_ids = set()
    for name in ("mu", "nu"):
        moments = getattr(adam[0], name)
        assert jax.tree.structure(moments) == jax.tree.structure(params)
        for (path, p), m in zip(param_leaves, jax.tree.leaves(moments), strict=True):
            where = f"{name}{jax.tree_util.keystr(path)}"
            assert m.shape == p.shape, where
            assert m.sharding.is_equivalent_to(p.sharding, p.ndim), where
            assert m.addressable_shards[0].data.shape == p.addressable_shards[0].data.shape, where
            # Every device holds the same slice of the moment as of the parameter.
            assert m.sharding.devices_indices_map(m.shape) == p.sharding.devices_indices_map(p.shape), where
            moment_ids.add(id(m))
    others = [x for x in jax.tree.leaves(state["opt_state"]) if id(x) not in moment_ids]
    assert others  # the Adam count, the schedule count, ...
    for x in others + [state["step"], state["key"]]:
        assert x.sharding.is_fully_replicated, x
    # The restore target promises the same layout as the state that is saved.
    for a, t in zip(jax.tree.leaves(state), jax.tree.leaves(s.abstract), strict=True):
        assert a.shape == t.shape and a.dtype == t.dtype
        assert a.sharding.is_equivalent_to(t.sharding, a.ndim)


# --------------------------------------------------------------------------------------
# 5. gradient accumulation
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("documents", [False, pytest.param(True, marks=pytest.mark.extended)], ids=["", "document-mask"])
def test_gradient_accumulation_matches_one_big_batch(text_data, documents):
    """With a document mask the micro-batches train different numbers of tokens (the
    separators' are masked), and the step still gives the big batch's mean."""
    results = {}
    for accum in (1, 2):
        # warmup 0: the first step already uses the peak learning rate, so parameters move.
        cfg = tiny_cfg("unused", text_data, optim__grad_accum=accum, optim__warmup_steps=0,
                       data__document_mask=documents)  # fmt: skip  data=8
        s = setup(cfg, separator=0 if documents else None)
        state = init_state(s)
        before = host_params(state)
        batch = fixed_batch(text_data, s.batch_sharding)
        if documents:  # separators in the even rows only: micro-batch 0 (rows 0, 2, ...) trains fewer tokens
            inputs = np.array(batch["inputs"])
            inputs[::2, 5::7] = 0
            assert (inputs == 0).sum() == 8 * 4
            batch = datalib.to_global({"inputs": inputs, "targets": np.array(batch["targets"])}, s.batch_sharding)
        step, taken = make_train_step(s), state
        state, metrics = step(state, batch)
        if accum == 1:  # the step donates its state: passing the one it took again is a clear error
            with pytest.raises(DonatedStateError, match="already passed to the step, which donates it"):
                step(taken, batch)
        results[accum] = (before, jax.device_get(metrics), host_params(state))
    (before, m1, p1), (before2, m2, p2) = results[1], results[2]
    assert_params_equal(before2, before)
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-6)
    np.testing.assert_allclose(m2["grad_norm"], m1["grad_norm"], rtol=1e-5)
    lr = float(m1["lr"])
    assert lr == pytest.approx(TrainConfig().optim.lr)
    for k in p1:
        moved = np.abs(p1[k] - before[k])
        assert moved.max() > lr / 2, f"{k} did not move"  # Adam's first step moves each weight by ~lr
        # That step is lr * g / (|g| + eps): a weight whose gradient is within a few eps of zero
        # moves by less, by an amount the rounding of g decides (the micro-batches sum in
        # another order: on jax 0.12.1 a weight whose gradient was 1.4 eps moved 0.58 lr in one
        # run and 0.60 lr in the other). The weights that move by 0.9 lr or more have gradients
        # of 9 eps or more, where rounding cannot matter: those must agree to 1% of lr.
        full = moved > 0.9 * lr
        np.testing.assert_allclose(p2[k][full], p1[k][full], rtol=0, atol=lr / 100, err_msg=k)
        np.testing.assert_array_less(np.abs(p2[k] - p1[k]), lr, err_msg=k)


# --------------------------------------------------------------------------------------
# 6. the run directory: metrics, plot, config
# --------------------------------------------------------------------------------------


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` as TensorBoard's own reader sees the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def assert_tensorboard_matches_metrics(run_dir):
    """Every number of every metrics.jsonl record, and nothing else, is a TensorBoard scalar
    at its step (float32 in the event file)."""
    want: dict[str, list] = {}
    for r in read_metrics(run_dir):
        for k, v in r.items():
            if k != "step":
                want.setdefault(k, []).append((r["step"], v))
    got = tensorboard_scalars(run_dir)
    assert got.keys() == want.keys(), (got.keys(), want.keys())
    for tag, values in want.items():
        assert [step for step, _ in got[tag]] == [step for step, _ in values], tag
        np.testing.assert_allclose([v for _, v in got[tag]], [v for _, v in values], rtol=1e-6, err_msg=tag)


def test_metrics_plot_tensorboard_profile_and_config_in_the_run_directory(tmp_path, text_data):
    """Also: TensorBoard's reader sees metrics.jsonl's scalars; --profile-steps 2:3 records a
    trace whose step annotations are exactly steps 2 and 3."""
    import glob
    import gzip

    run_dir = tmp_path / "run"
    cfg = tiny_cfg(run_dir, text_data, steps=6, log_every=4, eval_every=3, logging__profile_steps="2:3")
    result = quiet_train(cfg)

    records = read_metrics(run_dir)
    # Logged: every 4th step, every evaluation (3, 6) and the last step.
    assert [r["step"] for r in records] == [3, 4, 6]
    for r in records:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s"):
            assert key in r, (r["step"], key)
            assert math.isfinite(r[key]), (r["step"], key)
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert all(math.isfinite(r["val_loss"]) and r["val_loss"] > 0 for r in records if "val_loss" in r)
    assert result.final_loss == records[-1]["loss"]
    assert result.val_loss == records[-1]["val_loss"]

    png = run_dir / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((run_dir / "config.json").read_text())
    resolved = cfg.to_dict()
    resolved["optim"]["decay_steps"] = cfg.steps  # the schedule length is fixed by the first command
    assert saved["train"] == resolved
    assert saved["model"]["n_layer"] == 2 and saved["model"]["vocab_size"] == 256

    assert_tensorboard_matches_metrics(run_dir)
    (trace,) = glob.glob(str(run_dir / "profile" / "plugins" / "profile" / "*" / "perfetto_trace.json.gz"))
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    steps = [e for e in events if e.get("name") == "train"]  # one annotation per traced step
    assert sorted(int(e["args"]["step_num"]) for e in steps) == [2, 3]
    start, end = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    dispatches = [e for e in events if e.get("name") == "PjitFunction(step)"]  # the training step's
    assert dispatches and all(start <= e["ts"] <= end for e in dispatches)


# --------------------------------------------------------------------------------------
# 7. --init-from: a seed checkpoint or a Hugging Face directory
# --------------------------------------------------------------------------------------


def test_init_from_a_seed_checkpoint_starts_from_its_parameters(tmp_path, text_data, ref_run, monkeypatch, capsys):
    _, ref = ref_run  # seed 0
    seed0, seed5 = tmp_path / "seed0", tmp_path / "seed5"
    for seed, d in ((0, seed0), (5, seed5)):
        code = cli.main(["init", "--model", "gpt2-tiny", "--mesh", "fsdp=8", "--run-dir", str(d), "--seed", str(seed)])
        assert code == 0, capsys.readouterr().err
    assert "gpt2-tiny" in capsys.readouterr().out

    # Same seed as the fresh reference run: the same first step.
    seen = capture_first_state(monkeypatch)
    quiet_train(tiny_cfg(tmp_path / "a", text_data, steps=1, init_from=str(seed0)))
    assert read_metrics(tmp_path / "a")[0]["loss"] == ref[0]["loss"]
    fresh0 = fresh_params(text_data, seed=0)
    assert_params_equal(captured_values(seen), fresh0)

    # Another seed in the checkpoint than on the command line: the checkpoint's parameters win.
    seen = capture_first_state(monkeypatch, stop=True)
    with pytest.raises(_Captured):
        quiet_train(tiny_cfg(tmp_path / "b", text_data, init_from=str(seed5)))
    got = captured_values(seen)
    assert_params_equal(got, fresh_params(text_data, seed=5))
    assert not np.array_equal(got["['wte']['embedding']"], fresh0["['wte']['embedding']"])


def test_init_from_a_hugging_face_directory(tmp_path, text_data, monkeypatch):
    hf_dir = tmp_path / "hf"
    model = gpt2.GPT2(gpt2.preset("gpt2-tiny"), rngs=nnx.Rngs(11))
    gpt2.save_pretrained(model, hf_dir)
    want = {k: np.asarray(v) for k, v in flat(nnx.to_pure_dict(nnx.state(model))).items()}

    seen = capture_first_state(monkeypatch, stop=True)
    with pytest.raises(_Captured):
        quiet_train(tiny_cfg(tmp_path / "run", text_data, mesh="data=2,model=4", init_from=str(hf_dir)))
    got = captured_values(seen)
    assert_params_equal(got, want)
    fresh = fresh_params(text_data, seed=0)
    assert not np.array_equal(got["['wte']['embedding']"], fresh["['wte']['embedding']"])
    assert flat(seen["params"])["['h']['mlp']['c_fc']['kernel']"].shard_shape == (2, 64, 64)  # this run's layout


# --------------------------------------------------------------------------------------
# 8. sampling
# --------------------------------------------------------------------------------------


def _utf8_byte_bounds(text: str) -> tuple[int, int]:
    """Fewest and most bytes ``text`` can have come from (U+FFFD stands for 1 to 3 bytes)."""
    replaced = text.count("\ufffd")
    valid = len(text.replace("\ufffd", "").encode("utf-8"))
    return valid + replaced, valid + 3 * replaced


def test_sample_continues_the_prompt(ref_run):
    run_dir, _ = ref_run
    prompt, n = "def ", 20
    text = sample(run_dir, prompt, max_new_tokens=n)
    assert isinstance(text, str) and text.startswith(prompt)
    low, high = _utf8_byte_bounds(text)
    assert low <= len(prompt.encode()) + n <= high, repr(text)


def test_wandb_logs_the_metrics_records_and_is_never_required(tmp_path, text_data, monkeypatch):
    """With --wandb and the package importable (a stand-in module here: wandb is never a
    dependency), every metrics.jsonl record is logged at its step, in one W&B run that a
    resume continues; without the package, --wandb is one line before anything is written."""
    import sys
    import types

    from nnxscale.errors import ConfigError

    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.util = types.SimpleNamespace(generate_id=lambda: "abc123")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_dir = tmp_path / "run"
    quiet_train(tiny_cfg(run_dir, text_data, steps=3, save_every=2, logging__wandb="proj"))
    quiet_train(tiny_cfg(run_dir, text_data, steps=4, save_every=2, logging__wandb="proj"))  # resumes from step 3
    inits = [c[1] for c in calls if c[0] == "init"]
    assert [(kw["project"], kw["id"], kw["resume"]) for kw in inits] == [("proj", "abc123", "allow")] * 2
    logged = [(c[1], c[2]["loss"]) for c in calls if c[0] == "log"]
    assert logged == [(r["step"], r["loss"]) for r in read_metrics(run_dir)]
    assert [c[0] for c in calls].count("finish") == 2

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ConfigError, match="--wandb proj: the wandb package is not installed: pip install wandb"):
        quiet_train(tiny_cfg(tmp_path / "other", text_data, steps=2, logging__wandb="proj"))
    assert not (tmp_path / "other").exists()


def test_step_xla_options_reach_the_train_steps_compile(tmp_path, text_data, monkeypatch):
    """NNXSCALE_STEP_XLA_OPTIONS goes to the train step's compile (an option XLA does not
    know fails there, named); a value that is not a JSON object is one ConfigError, before
    the run directory is made. (tests/conftest.py sets it for the tests marked many_steps.)"""
    from nnxscale.errors import ConfigError
    from nnxscale.training.step import ENV_STEP_XLA_OPTIONS

    s = setup(tiny_cfg("unused", text_data))
    monkeypatch.setenv(ENV_STEP_XLA_OPTIONS, '{"xla_no_such_option": 1}')
    with pytest.raises(Exception, match="xla_no_such_option"):
        make_train_step(s).lower(s.abstract, s.abstract_batch).compile()
    for bad in ("-O1", "[1]", '{"xla_backend_optimization_level": '):
        monkeypatch.setenv(ENV_STEP_XLA_OPTIONS, bad)
        with pytest.raises(ConfigError, match=f"^{ENV_STEP_XLA_OPTIONS}=.* is not a JSON object of XLA options"):
            quiet_train(tiny_cfg(tmp_path / "run", text_data))
    assert not (tmp_path / "run").exists()
