"""What stops a run early: signals (a clean stop at a safe point) and divergence.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
from pathlib import Path
from typing import Callable, Optional

from nnxscale.errors import DivergenceError
from nnxscale.jobs.process import owns_process


class StopSignals:
    """SIGTERM and SIGINT (Ctrl-C) ask the run to stop cleanly: it saves, then returns.

    Installed first thing in :func:`~nnxscale.training.loop.train` and removed when it
    returns, so a signal during the sharded init or the first compilation is a request like
    any other: Python's default, a KeyboardInterrupt raised inside XLA's compiler, ended the
    process in a segmentation fault at exit. A second signal stops at once, without saving:
    the command exits (code 128 + signal, like ``kill -9``, after which a resume continues
    from the last complete checkpoint); a caller from Python gets ``KeyboardInterrupt``
    (:mod:`nnxscale.jobs.process`), at once unless the run is writing its records
    (:meth:`deferred`).

    Python runs a signal handler at whatever Python code the main thread is executing, and an
    exception raised inside a garbage-collector callback or a finalizer is only printed
    ("Exception ignored in"): JAX's ``_xla_gc_callback`` swallowed the second signal's
    ``KeyboardInterrupt`` in about 1 run in 30, and the run went on to save and return. So
    the interrupt is also recorded, and :meth:`check` raises it again (``train`` checks each
    step before its save, and once more as it returns).
    """

    def __init__(self):
        self.signal: Optional[int] = None
        self.interrupted: Optional[int] = None  # the second signal, once its KeyboardInterrupt was raised
        self._previous = {}
        self._deferring = False
        self._pending: Optional[int] = None

    def __bool__(self) -> bool:
        return self.signal is not None

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: the caller handles interruption
                pass
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def check(self) -> None:
        """Raise the second signal's ``KeyboardInterrupt`` again if the run is still going:
        Python swallowed it (raised inside a garbage-collector callback or a finalizer)."""
        if self.interrupted is not None:
            raise _interrupt_error(self.interrupted)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    @contextlib.contextmanager
    def deferred(self):
        """A second signal inside the block raises its ``KeyboardInterrupt`` when the block ends.

        For the calls into libraries that hold a lock across Python code: a ``KeyboardInterrupt``
        raised inside tensorboardX's writer left its queue's lock held, and the caller's process
        hung at exit in the writer's own clean-up (seen once in the suite, the second signal
        arriving as the run opened its TensorBoard events). The command still exits at once.
        """
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            if self._pending is not None:
                signum, self._pending = self._pending, None
                self._interrupt(signum)

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            if owns_process():
                os._exit(128 + signum)
            if self._deferring:
                self._pending = signum
                return
            self._interrupt(signum)
        self.signal = signum
        os.write(2, f"\nnnxscale: {name}: stopping as soon as it is safe; {name} again stops at once, unsaved\n".encode())

    def _interrupt(self, signum: int) -> None:
        self._restore()  # the caller's handlers again, before its KeyboardInterrupt
        self.interrupted = signum
        raise _interrupt_error(signum)


def _interrupt_error(signum: int) -> KeyboardInterrupt:
    name = signal.Signals(signum).name
    return KeyboardInterrupt(f"{name} while stopping: the run ended at once, without saving")


class SkipCounter:
    """The host's half of the divergence guard: counts the steps that the jitted step
    skipped (:func:`skip_nonfinite`); :meth:`check` stops the run after ``limit`` in a row."""

    def __init__(self, limit: int, total: int, lr: float, run_dir: Path):
        self.limit, self.total, self.lr, self.run_dir = limit, total, lr, run_dir
        self.streak = 0
        self.last_bad: tuple[int, dict] = (0, {})

    def seen(self, step: int, metrics: dict) -> None:
        """Account for ``step``'s metrics (host values)."""
        if not metrics["skipped"]:
            self.streak = 0
            return
        self.total += 1
        self.streak += 1
        self.last_bad = (step, metrics)

    def check(self, latest_checkpoint: Callable[[], Optional[int]]) -> None:
        """Raise DivergenceError if the last ``limit`` steps accounted for were all skipped."""
        if self.streak < self.limit:
            return
        step, metrics = self.last_bad
        bad = [f"{name} {metrics[key]}" for key, name in (("loss", "loss"), ("grad_norm", "gradient norm"))
               if not math.isfinite(metrics[key])]  # fmt: skip
        latest = latest_checkpoint()
        restart = f" (--init-from {self.run_dir} starts from its step {latest})" if latest is not None else ""
        raise DivergenceError(
            f"training diverged at step {step}: {' and '.join(bad)}, non-finite for {self.streak} steps in a row "
            f"(steps {step - self.streak + 1}-{step}), each skipped, so no parameter or checkpoint holds them; "
            f"try a lower --lr (this run: {self.lr:g}), more --warmup-steps or a --grad-clip in a new --run-dir{restart}"
        )
