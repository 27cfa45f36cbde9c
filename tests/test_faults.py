"""When things go wrong: divergence, a full disk, two trainers on one run directory,
kill -9 at random moments, Ctrl-C during compilation, a kill between a save and its
clean-up. Each fault is real (a NaN loss, a file system that fills up, a second process,
a signal), and each test checks what a user relies on afterwards: one clear line, finite
checkpoints, readable metrics, and a resume that continues the run exactly.

Runs are the byte-level ``gpt2-tiny`` of ``test_train.py``, batch 16 x 32, a few steps.
"""

import functools
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from fault_injection import can_mount, small_filesystem
from test_train import PINNED_SCHEDULE, assert_tensorboard_matches_metrics, quiet_train, tiny_cfg

from nnxscale.checkpoint.checkpointer import Checkpointer, checkpoint_dir
from nnxscale.cli.commands import main
from nnxscale.training.config import TrainConfig
from nnxscale.errors import RunFileError
from nnxscale.training.rundir import read_metrics
from nnxscale.training.state import setup



def cli_command(run_dir, data, *extra) -> list[str]:
    """``python -m nnxscale train`` for ``tiny_cfg``'s run (pinned schedule, every step logged)."""
    return [
        sys.executable, "-m", "nnxscale", "train", "--model", "gpt2-tiny", "--mesh", "data=8",
        "--batch-size", "16", "--seq-len", "32", "--eval-every", "0", "--log-every", "1",
        "--warmup-steps", str(PINNED_SCHEDULE["optim.warmup_steps"]),
        "--min-lr-ratio", str(PINNED_SCHEDULE["optim.min_lr_ratio"]),
        "--data", str(data), "--run-dir", str(run_dir), "--no-progress", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def compile_cache() -> dict:
    """Extra environment for trainer processes: none, since they inherit the suite's
    persistent compilation cache (``conftest.py``). The first process compiles (about 10 s
    on 2 cores), the next ones load the same executables in about 1 s; a kill in the middle
    of writing an entry only wastes that entry (JAX then compiles again)."""
    return {}


def popen(command, env: dict = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "NNXSCALE_DEBUG"} | (env or {})
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def run_cli(command, env: dict = None, timeout=300) -> subprocess.CompletedProcess:
    p = popen(command, env)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(command, p.returncode, out, err)


def last_logged_step(run_dir) -> int:
    """The newest step in ``metrics.jsonl`` while a trainer may be writing it (0 if none)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except ValueError:  # the line being written
            continue
    return 0


def wait_for(condition, proc, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the trainer ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def one_line_error(proc, *words):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("nnxscale: error: ") and "Traceback" not in proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def strict_json_records(run_dir) -> list[dict]:
    """Every line of ``metrics.jsonl`` parsed as strict JSON (bare NaN or Infinity fail)."""

    def refuse(token):
        raise AssertionError(f"metrics.jsonl holds {token}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def restore_every_step(run_dir) -> dict[int, dict]:
    """Each kept checkpoint's state as host numpy, verified against its checksums."""
    s = setup(TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text())["train"]))
    out = {}
    with Checkpointer(checkpoint_dir(run_dir), async_save=False) as ckpt:
        for step in ckpt.steps():
            state, _ = ckpt.restore(s.abstract, step=step)
            out[step] = jax.device_get(state)
    return out


# --------------------------------------------------------------------------------------
# divergence
# --------------------------------------------------------------------------------------


def test_a_diverging_run_skips_its_bad_steps_stops_and_keeps_finite_checkpoints(tmp_path, text_data, capsys):
    """--lr 1e6: the loss overflows within a few steps. Those updates are skipped inside the
    step, the run stops after --max-bad-steps in a row with one line, every checkpoint
    is finite, and metrics.jsonl stays strict JSON."""
    run_dir = tmp_path / "run"
    argv = cli_command(run_dir, text_data, "--lr", "1e6", "--steps", "40", "--save-every", "2", "--max-bad-steps", "3")
    code = main(argv[3:])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    line = err.strip()
    assert line.startswith("nnxscale: error: training diverged at step ") and "\n" not in line, err
    assert "non-finite for 3 steps in a row" in line and "--lr (this run: 1e+06)" in line

    records = strict_json_records(run_dir)
    skipped = [r for r in records if r["loss"] is None or r["grad_norm"] is None]
    assert len(skipped) >= 3  # logged as null, not as bare NaN
    assert records[-1]["skipped_steps"] == len(skipped)
    assert [r["skipped_steps"] for r in records] == sorted(r["skipped_steps"] for r in records)
    assert records[-1]["step"] < 40  # it stopped

    states = restore_every_step(run_dir)
    assert states and max(states) <= records[-1]["step"]
    for step, state in states.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(state):
            if np.issubdtype(np.asarray(leaf).dtype, np.floating):
                assert np.isfinite(leaf).all(), f"checkpoint step {step} {jax.tree_util.keystr(path)}"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_step_changes_nothing_and_a_finite_one_updates(bad):
    """The guard inside the jitted step, with the state donated as the trainer donates it:
    a NaN or Inf loss leaves every parameter and optimizer array bit for bit as it was (the
    step counter advances, ``skipped`` is 1); a finite one applies the update."""
    import jax.numpy as jnp
    import optax

    from nnxscale.training.step import skip_nonfinite

    tx = optax.adamw(0.1)
    def fresh():  # new arrays each time: the step donates (deletes, from jaxlib 0.12.1 on CPU) the ones it takes
        params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "b": jnp.ones(3)}
        return {"params": params, "opt_state": tx.init(params), "step": jnp.int32(4), "key": jnp.zeros(2, jnp.uint32)}

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, loss):
        grads = jax.tree.map(lambda p: jnp.full_like(p, loss), state["params"])

        def update(p, o):
            updates, o = tx.update(grads, o, p)
            return optax.apply_updates(p, updates), o

        return skip_nonfinite(state, update, {"loss": loss, "grad_norm": optax.tree.norm(grads)})

    before = jax.tree.map(np.asarray, fresh())
    kept, metrics = step(fresh(), jnp.float32(bad))
    assert int(metrics["skipped"]) == 1 and int(kept["step"]) == 5
    for part in ("params", "opt_state"):
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, kept[part]), before[part])
    moved, metrics = step(fresh(), jnp.float32(0.5))
    assert int(metrics["skipped"]) == 0 and int(moved["step"]) == 5
    assert not np.array_equal(np.asarray(moved["params"]["w"]), before["params"]["w"])


# --------------------------------------------------------------------------------------
# a full disk, then a resume
# --------------------------------------------------------------------------------------


@pytest.mark.skipif(not can_mount(), reason="mounting a small tmpfs is not possible here (tried: mount -t tmpfs)")
def test_a_disk_that_fills_mid_run_then_a_resume(tmp_path, text_data, compile_cache):
    """A 5 MB file system holds 3 checkpoints (1.5 MB each): the 4th save fails mid-run.
    One line says so, naming where; the finished checkpoints stay intact; after space is
    freed the same command resumes, repairing a partial metrics line a crash would leave."""
    mount = tmp_path / "small"
    with small_filesystem(mount, "5m") as grow:
        run_dir = mount / "run"
        command = cli_command(run_dir, text_data, "--steps", "10", "--save-every", "1")
        proc = run_cli(command, compile_cache)
        line = one_line_error(proc, "disk full", str(checkpoint_dir(run_dir)))
        assert "saving checkpoint step" in line
        states = restore_every_step(run_dir)  # each finalized step restores and verifies
        assert len(states) >= 2
        last_saved = max(states)
        records = strict_json_records(run_dir)  # whole lines only
        assert [r["step"] for r in records] == list(range(1, records[-1]["step"] + 1))

        grow("64m")  # space freed
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write('{"step": 99, "loss": 1.2')  # what a crash in the middle of a write leaves
        logs = []
        result = quiet_train(tiny_cfg(run_dir, text_data, steps=10, save_every=1), log=logs.append)
        assert result.start_step == last_saved and result.final_step == 10, logs
        assert [r["step"] for r in strict_json_records(run_dir)] == list(range(1, 11))
        assert not [p for p in checkpoint_dir(run_dir).iterdir() if "tmp" in p.name]  # unfinished save removed


def test_a_failed_metrics_write_leaves_whole_lines(tmp_path):
    """A write cut short by a file-size limit (EFBIG, enforced by the kernel in a child
    process) is taken back: metrics.jsonl keeps whole lines, and the error names the file."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n')
    child = f"""
import resource, signal
from pathlib import Path
from nnxscale.errors import StorageError
from nnxscale.training.rundir import append_metrics
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({path.stat().st_size + 20}, resource.RLIM_INFINITY))
try:
    append_metrics(Path({str(path)!r}), {{"step": 2, "loss": 1.5, "grad_norm": 0.25, "lr": 0.001}})
except StorageError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert f"writing {path} failed: file too large" in out.stdout, out.stdout + out.stderr
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n'


def test_a_damaged_metrics_line_is_named(tmp_path):
    run_dir = tmp_path
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(RunFileError, match=rf"{run_dir / 'metrics.jsonl'} line 2 is not a metrics record"):
        read_metrics(run_dir)


# --------------------------------------------------------------------------------------
# one trainer per run directory
# --------------------------------------------------------------------------------------


def test_a_second_trainer_is_refused_and_a_killed_ones_lock_is_stale(tmp_path, text_data, capsys, compile_cache):
    run_dir = tmp_path / "run"
    first = popen(cli_command(run_dir, text_data, "--steps", "100000", "--save-every", "3"), compile_cache)
    try:
        wait_for((checkpoint_dir(run_dir) / "3").exists, first, "a checkpoint")
        t_refused = time.monotonic()
        code = main(cli_command(run_dir, text_data, "--steps", "100000", "--save-every", "3")[3:])
        out, err = capsys.readouterr()
        assert code == 2, out + err
        assert time.monotonic() - t_refused < 60  # at once: it does not wait for the holder
        line = err.strip()
        assert "\n" not in line and f"run directory {run_dir} is in use by another trainer" in line
        assert f"host {socket.gethostname()}, process {first.pid}, since 20" in line
        assert first.poll() is None  # the first trainer runs on, undisturbed
        first.kill()  # kill -9: the lock file stays, with the dead holder's details
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert json.loads((run_dir / "lock").read_text())["pid"] == first.pid

    with Checkpointer(checkpoint_dir(run_dir)) as ckpt:
        latest = ckpt.latest_step()
    assert latest >= 3
    result = quiet_train(tiny_cfg(run_dir, text_data, steps=latest + 2, save_every=3))
    assert result.start_step == latest and result.final_step == latest + 2
    assert (run_dir / "lock").read_text() == ""  # released at the end


# --------------------------------------------------------------------------------------
# kill -9 at random moments
# --------------------------------------------------------------------------------------


@pytest.mark.many_steps
@pytest.mark.extended  # the suite's: test_train's SIGTERM resume, a kill between a save and its clean-up
def test_kill_9_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path, text_data, compile_cache, capsys):
    """Three kill -9s at random moments, many during an asynchronous save (one every 2
    steps): each resume continues from the last complete checkpoint, and the losses of
    the whole run are bit-identical to a run that was never stopped (run here, with the
    same command: it compiles the programs the killed processes then load).

    24 steps: each process is killed within 0.2 s of logging a step it had not logged
    before, and resumes from the last even step, so three kills leave most of the run to
    the last process (they were 40; each step and each save costs about as much again)."""
    steps, kills = 24, 3
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    whole = cli_command(tmp_path / "whole", text_data, "--steps", str(steps), "--save-every", "2")
    assert whole[1:4] == ["-m", "nnxscale", "train"]
    assert main(whole[3:]) == 0, capsys.readouterr().err[-3000:]
    run_dir = tmp_path / "cut"
    command = cli_command(run_dir, text_data, "--steps", str(steps), "--save-every", "2")
    moments = []
    for _ in range(kills):
        proc = popen(command, compile_cache)
        try:
            seen = last_logged_step(run_dir)
            wait_for(lambda: last_logged_step(run_dir) > seen, proc, "a new step")  # compiled and running
            time.sleep(rng.uniform(0, 0.2))
            moments.append(last_logged_step(run_dir))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"seed {seed}: ended before the kill: {proc.communicate()}"
    done = run_cli(command, compile_cache)
    assert done.returncode == 0, f"seed {seed}, killed near steps {moments}: {done.stderr[-3000:]}"

    got, want = read_metrics(run_dir), read_metrics(tmp_path / "whole")
    assert [r["step"] for r in got] == list(range(1, steps + 1)), f"seed {seed}, killed near steps {moments}"
    for a, b in zip(got, want):
        for key in ("loss", "grad_norm", "lr"):
            assert a[key] == b[key], f"step {a['step']} {key}: seed {seed}, killed near steps {moments}"
    # Steps logged after the last checkpoint and trained again are in TensorBoard once too:
    # each resume purges what followed its checkpoint.
    assert_tensorboard_matches_metrics(run_dir)


# --------------------------------------------------------------------------------------
# interrupts, and the clean-up a kill prevented
# --------------------------------------------------------------------------------------


def test_ctrl_c_during_the_sharded_init_and_compilation_stops_cleanly(tmp_path, text_data):
    """SIGINT as soon as the run directory appears (the init and the first compilations
    are still ahead) ends the run with exit 130 and no traceback or segmentation fault;
    the same command then trains as if nothing had happened."""
    run_dir = tmp_path / "run"
    command = cli_command(run_dir, text_data, "--steps", "3")
    proc = popen(command)
    try:
        wait_for(run_dir.exists, proc, "the run directory")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, out, err[-3000:])
    assert "Traceback" not in err and "Fatal Python error" not in err, err[-3000:]
    assert "stopped by SIGINT" in out
    assert main(command[3:]) == 0  # the same command, here: no second process to start
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


def test_a_kill_between_a_save_and_its_clean_up_is_cleaned_by_the_next_run(tmp_path, text_data):
    """A save removes the steps beyond --keep only after it is final; a kill in between
    leaves keep + 1, which the next run removes, even one with nothing left to train."""
    run_dir = tmp_path / "run"
    cfg = tiny_cfg(run_dir, text_data, steps=3, save_every=1, keep=2)
    quiet_train(cfg)
    root = checkpoint_dir(run_dir)
    assert sorted(p.name for p in root.iterdir()) == ["2", "3"]
    shutil.copytree(root / "2", root / "1")  # the step that the kill left behind
    result = quiet_train(cfg)
    assert result.final_step == result.start_step == 3
    assert sorted(p.name for p in root.iterdir()) == ["2", "3"]
    assert math.isfinite(read_metrics(run_dir)[-1]["loss"])
