"""Called from Python, nnxscale leaves the process to its owner; the command owns its own.

A script or notebook that calls ``nnxscale.train`` keeps its signal handlers, its logging
and its standard error: a first Ctrl-C still stops the run at a safe point with a
checkpoint, a second raises ``KeyboardInterrupt`` in the caller (never ``os._exit``), and
nothing process-wide is changed beyond the call. The command (``nnxscale.cli.main``) owns
its process: there a second signal ends it at once, and Orbax's echoes of an error it
reports are held back.
"""

import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax.numpy as jnp

from nnxscale.checkpoint.checkpointer import Checkpointer, _FILTERED_LOGGERS, _quiet_orbax_errors, checkpoint_dir
from nnxscale.jobs.process import owned_by_command, owns_process
from test_train import quiet_train, tiny_cfg



def installed_filters() -> list:
    return [f for name in _FILTERED_LOGGERS for f in logging.getLogger(name).filters if f is _quiet_orbax_errors]


def test_a_checkpointer_opened_from_python_leaves_logging_alone(tmp_path):
    """From Python, nothing is filtered; under the command, Orbax's echoes of a failed save
    are held back only while a save is in flight."""
    hook = sys.unraisablehook
    with Checkpointer(tmp_path / "a"):
        assert not installed_filters() and sys.unraisablehook is hook
    assert not owns_process()
    with owned_by_command():
        assert owns_process()
        with Checkpointer(tmp_path / "b") as ckpt:
            assert not installed_filters() and sys.unraisablehook is hook  # only while a save is in flight
            ckpt.save(1, {"x": jnp.arange(4.0)}, {})
            assert len(installed_filters()) == len(_FILTERED_LOGGERS) and sys.unraisablehook is not hook
            ckpt.wait()
            assert not installed_filters() and sys.unraisablehook is hook  # put back once it succeeded
            ckpt.save(2, {"x": jnp.arange(4.0)}, {})
        assert not installed_filters() and sys.unraisablehook is hook  # and when it closes
    assert not owns_process()


def test_only_the_echoes_of_a_failed_save_are_held_back():
    """Orbax's own error lines are shown unless they repeat a failed save's error (which
    Checkpointer.wait reports in one line; the full-disk run in test_faults checks that)."""
    orbax_file = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "async_checkpointer.py")

    def record(message, level=logging.ERROR, path=orbax_file):
        return logging.LogRecord("absl", level, path, 1, message, None, None)

    shown = _quiet_orbax_errors.filter
    assert not shown(record("[process=0][thread=array_type_handler] _SignalingThread.run() raised an exception: RESOURCE_EXHAUSTED"))
    assert not shown(record("[process=0][step=4][wait_until_finished] Save Finalize thread (save_finalize) failed."))
    assert shown(record("Failed to read the checkpoint metadata: PERMISSION_DENIED"))  # anything else Orbax says
    assert shown(record("_SignalingThread.run() raised an exception", path=__file__))  # not Orbax's
    assert shown(record("Save Finalize thread (save_finalize) failed.", level=logging.WARNING))


_SCRIPT = """
import logging, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_train import tiny_cfg
import nnxscale

handler = lambda *a: None
signal.signal(signal.SIGTERM, handler)
# Python's own Ctrl-C handler, which a process started from a shell's background job lacks
# (it inherits SIGINT ignored, e.g. under `pytest ... &`).
signal.signal(signal.SIGINT, signal.default_int_handler)
hook = sys.unraisablehook
try:
    nnxscale.train(tiny_cfg({run_dir!r}, {data!r}, steps=100000, save_every=5), progress=False, log=lambda _: None)
except KeyboardInterrupt as e:
    print("KeyboardInterrupt:", e, flush=True)
assert signal.getsignal(signal.SIGTERM) is handler, "the caller's SIGTERM handler is not back"
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "Python's SIGINT handler is not back"
assert sys.unraisablehook is hook
assert not [f for n in ("absl", "asyncio") for f in logging.getLogger(n).filters]
print("CALLER STILL RUNNING", flush=True)
"""


def test_a_second_signal_raises_keyboard_interrupt_in_the_caller(tmp_path, text_data):
    run_dir = tmp_path / "run"
    script = _SCRIPT.format(tests=os.path.dirname(__file__), run_dir=str(run_dir), data=str(text_data))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNXSCALE_")}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # a clean stop, asked for ...
        proc.send_signal(signal.SIGTERM)  # ... and a second signal before it happened
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]  # not os._exit(128 + signal): the caller went on
    assert "KeyboardInterrupt: SIGTERM while stopping" in out, (out, err[-2000:])
    assert "CALLER STILL RUNNING" in out
    assert "stopping as soon as it is safe" in err
    # Nothing saved is lost: whatever completed is a step; a save the second signal cut short
    # is an unfinished one (never listed; the next run removes it).
    names = [p.name for p in checkpoint_dir(run_dir).iterdir() if p.is_dir()]
    assert all(n.isdigit() or n.endswith(".orbax-checkpoint-tmp") for n in names), names
    with Checkpointer(checkpoint_dir(run_dir)) as ckpt:
        assert ckpt.steps() == sorted(int(n) for n in names if n.isdigit())


def test_a_second_signal_while_the_records_are_written_raises_after_them():
    """Inside ``deferred`` (the run writing metrics.jsonl and its TensorBoard events) the
    second signal's KeyboardInterrupt waits for the block to end: raised inside tensorboardX's
    writer, it had left a lock held and the caller's process hung at exit."""
    from nnxscale.training.guards import StopSignals

    previous = signal.getsignal(signal.SIGINT)
    finished = []
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # the first: a request to stop at a safe point
        time.sleep(0.01)
        assert stop.signal == signal.SIGTERM
        try:
            with stop.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(100):  # the handler runs between these lines, and raises nothing
                    time.sleep(0.001)
                finished.append(True)
        except KeyboardInterrupt as e:
            assert str(e) == "SIGINT while stopping: the run ended at once, without saving"
        else:
            raise AssertionError("no KeyboardInterrupt after the block")
    assert finished == [True]
    assert signal.getsignal(signal.SIGINT) is previous


def test_a_second_signal_that_python_swallowed_still_ends_the_run_unsaved(tmp_path, text_data):
    """Python runs a signal handler inside whatever the main thread executes, and prints (only)
    an exception raised inside a garbage-collector callback: CI saw JAX's ``_xla_gc_callback``
    swallow the second signal's KeyboardInterrupt, and the run saved and returned. Here both
    signals arrive inside a gc callback, every time; the run must still end unsaved with
    KeyboardInterrupt."""
    run_dir = tmp_path / "run"
    sent, swallowed = [], []

    def dispatching() -> bool:  # a step: not the records, where the second signal waits (deferred)
        frame = sys._getframe()
        while frame is not None and frame.f_code.co_name != "dispatch":
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename.endswith(os.path.join("training", "loop.py"))

    def signal_inside_gc(phase, _info):
        if sent or phase != "start" or threading.current_thread() is not threading.main_thread():
            return
        if dispatching():
            sent.append(True)
            signal.raise_signal(signal.SIGINT)  # the first: a clean stop, asked for
            signal.raise_signal(signal.SIGTERM)  # the second raises here, and gc only prints it

    hook = sys.unraisablehook
    sys.unraisablehook = lambda u: swallowed.append(u.exc_type)
    gc.callbacks.append(signal_inside_gc)
    try:
        quiet_train(tiny_cfg(run_dir, text_data, steps=100000, save_every=0))
    except KeyboardInterrupt as e:
        assert str(e) == "SIGTERM while stopping: the run ended at once, without saving"
    else:
        raise AssertionError(f"the run returned after the second signal (swallowed: {swallowed})")
    finally:
        gc.callbacks.remove(signal_inside_gc)
        sys.unraisablehook = hook
    assert sent and KeyboardInterrupt in swallowed  # the case this test is for happened
    assert not checkpoint_dir(run_dir).exists() or not any(checkpoint_dir(run_dir).iterdir())  # unsaved
