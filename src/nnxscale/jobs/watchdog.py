"""A watchdog for progress, not only for life: a job whose steps stop completing is ended.

JAX's heartbeat ends a job when a process *dies*; nothing ends one whose processes are all
alive and waiting: a deadlock between collectives, a stuck filesystem, a peer paused with
SIGSTOP. :class:`ProgressWatchdog` runs a thread beside the training loop. The loop tells
it when it enters a phase (:meth:`~ProgressWatchdog.phase`: restoring, a training step, a
save, an evaluation) and when something completes (:meth:`~ProgressWatchdog.progress`).
When nothing completes for the phase's limit, the watchdog

1. writes the Python stacks of every thread of this process (``faulthandler``) to
   ``RUN_DIR/logs/stacks_<process>.txt`` and one line naming the phase to
   ``RUN_DIR/logs/hang_<process>.txt`` (what ``nnxscale launch`` prints);
2. prints that line, and ends the process with :data:`EXIT_HUNG`; in a job of several
   processes it first records the failure (:func:`nnxscale.jobs.distributed.leave`), so the
   processes that are still waiting write their stacks and end too.

The limit: ``timeout`` seconds (``--hang-timeout``, ``NNXSCALE_HANG_TIMEOUT``) when given,
with :data:`COMPILE_FLOOR_S` for the phases that compile (the first step, the first save
and the first evaluation); by default ``max(STEP_FLOOR_S, 50 x the median step time)`` per
step and ``SAVE_FLOOR_S`` for a save or an evaluation, :data:`FIRST_FLOOR_S` until the
first step completes. ``timeout=0`` turns the watchdog off.

``faulthandler`` also writes the stacks to the same file if the process aborts (JAX ends a
process with SIGABRT when a peer's heartbeats stop, e.g. one paused with SIGSTOP), and on
SIGUSR1, which ``nnxscale launch`` sends to every process before it stops a stalled job.

Ending the process is the only way out of a thread stuck inside XLA, so the watchdog does
it also when ``nnxscale.train`` is called from Python; pass ``hang_timeout=0`` to keep a
process that must never exit on its own.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from nnxscale.jobs import distributed

#: Exit code of a process that made no progress for its limit (see the module docstring).
EXIT_HUNG = 4
ENV_HANG_TIMEOUT = "NNXSCALE_HANG_TIMEOUT"

FIRST_FLOOR_S = 1800.0  # default limit until the first step completes: restore and compile
STEP_FLOOR_S = 300.0  # default limit per step, at least
STEP_MULTIPLE = 50  # default limit per step: this many median step times
SAVE_FLOOR_S = 900.0  # default limit for a save or an evaluation
COMPILE_FLOOR_S = 300.0  # with an explicit timeout: at least this for a phase that compiles
_CHECK_S = 0.5


def stacks_file(logs: Path, process: int) -> Path:
    return logs / f"stacks_{process}.txt"


def hang_file(logs: Path, process: int) -> Path:
    return logs / f"hang_{process}.txt"


class ProgressWatchdog:
    """See the module docstring. A context manager: ``with ProgressWatchdog(...) as watch:``."""

    def __init__(self, timeout: Optional[float], logs: Path, *, process: int = 0, resume_hint: str = ""):
        self.timeout = timeout  # None: the default limits; 0: off
        self.logs, self.process, self.resume_hint = Path(logs), process, resume_hint
        self._lock = threading.Lock()
        self._name = "starting"
        self._limit = FIRST_FLOOR_S if timeout is None else max(timeout, COMPILE_FLOOR_S)
        self._since = time.monotonic()
        self._last_done = "nothing yet"
        self._step_times: list[float] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stacks = None

    @property
    def enabled(self) -> bool:
        return self.timeout != 0

    def __enter__(self) -> ProgressWatchdog:
        if not self.enabled:
            return self
        self.logs.mkdir(parents=True, exist_ok=True)
        self._stacks = open(stacks_file(self.logs, self.process), "a")
        self._enabled_faulthandler = not faulthandler.is_enabled()  # the caller's own stays as it is
        if self._enabled_faulthandler:  # a crash or abort leaves the stacks here too
            faulthandler.enable(self._stacks, all_threads=True)

        distributed.stacks_on_peer_failure(self._stacks)
        if threading.current_thread() is threading.main_thread():
            try:
                faulthandler.register(signal.SIGUSR1, self._stacks, all_threads=True, chain=False)
            except (AttributeError, ValueError):  # no SIGUSR1 (Windows)
                pass
        self._thread = threading.Thread(target=self._watch, name="nnxscale-progress-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:  # off, or __enter__ failed before starting it
            return
        self._stop.set()
        self._thread.join(timeout=2 * _CHECK_S)

        distributed.stacks_on_peer_failure(None)
        try:
            faulthandler.unregister(signal.SIGUSR1)
        except (AttributeError, ValueError):
            pass
        if self._enabled_faulthandler:
            faulthandler.disable()
        self._stacks.close()
        if os.path.getsize(self._stacks.name) == 0:
            os.unlink(self._stacks.name)

    # -- called by the loop ----------------------------------------------------------------

    def phase(self, name: str, *, compiles: bool = False, kind: str = "step") -> None:
        """Entering ``name``, whose limit applies from the last progress. ``kind``: "step",
        "save" or "eval"; ``compiles``: the phase includes a compilation."""
        with self._lock:
            self._name = name
            self._limit = self._limit_for(kind, compiles)

    def progress(self, what: str, *, step_time: Optional[float] = None) -> None:
        """``what`` completed (e.g. "step 12"); ``step_time`` feeds the default limit."""
        with self._lock:
            self._last_done = what
            self._since = time.monotonic()
            if step_time is not None:
                self._step_times = (self._step_times + [step_time])[-100:]

    def _limit_for(self, kind: str, compiles: bool) -> float:
        if self.timeout is not None:
            return max(self.timeout, COMPILE_FLOOR_S) if compiles else self.timeout
        if not self._step_times:
            return FIRST_FLOOR_S
        if kind != "step":
            return SAVE_FLOOR_S
        return max(STEP_FLOOR_S, STEP_MULTIPLE * statistics.median(self._step_times))

    # -- the thread ------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(_CHECK_S):
            with self._lock:
                idle = time.monotonic() - self._since
                if idle < self._limit:
                    continue
                name, limit, last = self._name, self._limit, self._last_done
            self._fire(name, limit, last)
            return

    def _fire(self, name: str, limit: float, last: str) -> None:
        stacks = stacks_file(self.logs, self.process)
        line = (
            f"no progress for {limit:.0f} s in {name} (last completed: {last}) on process {self.process}: "
            f"the job is stuck; the Python stacks of every thread are in {stacks}"
        )
        try:
            self._stacks.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
            self._stacks.flush()
            faulthandler.dump_traceback(self._stacks, all_threads=True)
            self._stacks.flush()
            hang_file(self.logs, self.process).write_text(line + "\n")
        except OSError as e:  # a full or stuck disk must not keep the process alive
            line += f" (could not write them: {e})"
        message = f"nnxscale: error: {line}. {self.resume_hint}".rstrip()
        print(message, file=sys.stderr, flush=True)
        if distributed.current().is_multiprocess:
            distributed.leave(EXIT_HUNG, line)  # tells the others, then exits
        os._exit(EXIT_HUNG)


def timeout_from(value: Optional[float], environ=os.environ) -> Optional[float]:
    """The hang timeout in force: ``value`` if given, else ``NNXSCALE_HANG_TIMEOUT``, else ``None``
    (the default limits). Raises ValueError for a negative or non-numeric value."""
    if value is None and environ.get(ENV_HANG_TIMEOUT, "").strip():
        text = environ[ENV_HANG_TIMEOUT].strip()
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{ENV_HANG_TIMEOUT}={text!r} is not a number of seconds (0 turns the watchdog off)") from None
    if value is not None and value < 0:
        raise ValueError(f"--hang-timeout must be 0 (off) or a positive number of seconds, got {value:g}")
    return value
