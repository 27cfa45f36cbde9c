"""``nnxscale launch``: the processes of a multi-process job, started and supervised in one command.

``nnxscale launch -n 2 --cpu-devices 4 -- train --mesh data=4,model=2`` starts two
``nnxscale train`` processes on this machine as one ``jax.distributed`` job (coordinator
on a free loopback port, process ids 0 and 1, 4 CPU devices each) and supervises them,
with torchrun's contract:

- every line a process writes is printed with its process id in front (``[1] ...``) and
  kept, unprefixed, in a log per process (``RUN_DIR/logs/process_1.log``, appended);
  process 0 alone prints results and the progress bar;
- SIGINT and SIGTERM are forwarded to every process, which stop together at one step and
  save it (the launcher then exits 130 or 143, as they do); a second signal kills them;
- when one process fails (exits non-zero, or dies of a signal), the others get SIGTERM and,
  ``grace`` seconds later, SIGKILL; the launcher prints one line naming the process and
  how it ended, and exits non-zero. When the failure is a process that stopped making
  progress (exit code 4, the trainer's ``--hang-timeout``), every process is first
  resumed (SIGCONT) and asked for its stacks (SIGUSR1, written by ``faulthandler`` to
  ``RUN_DIR/logs/stacks_<id>.txt``), and the line names the stalled phase. No process outlives the launcher: each runs in its
  own session, is ended with its whole process group, and on Linux gets SIGKILL if the
  launcher itself dies.

With ``nnodes > 1`` the same command on every machine (each with its ``node_rank`` and
node 0's address as ``coordinator``) makes one job of ``nnodes x nproc`` processes.

This module never imports jax: the launcher only starts and watches processes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from nnxscale.errors import JobError
from nnxscale.jobs.distributed import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    EXIT_PEER_FAILED,
    JobSpec,
)
from nnxscale.jobs.watchdog import EXIT_HUNG

#: The nnxscale commands that use devices, and so can run as processes of a job.
COMMANDS = ("train", "init", "sample", "plan")

DEFAULT_TOTAL_CPU_DEVICES = 8  # as a single process: the launcher splits them by default

# Gloo prints a line per communicator it connects ("[Gloo] Rank 3 is connected to 7 peer
# ranks. Expected number of connected peer ranks is : 7"), dozens per job, from several
# threads at once (so a line may be split); they go to the logs only.
_GLOO_CHATTER = b"connected peer ranks"

_POLL_S = 0.05
_STACKS_S = 1.0  # after SIGUSR1, how long the processes get to write their stacks
_STOP_WAIT_S = 120.0  # after one process stopped on a signal, how long the others may take to save and stop


def launch(
    command: list[str],
    *,
    nproc: int,
    cpu_devices: Optional[int] = None,
    port: Optional[int] = None,
    nnodes: int = 1,
    node_rank: int = 0,
    coordinator: Optional[str] = None,
    grace: float = 3.0,
    log_dir=None,
) -> int:
    """Run ``nproc`` processes of ``nnxscale COMMAND...`` as (part of) one job; returns the exit code.

    Args:
      command: the nnxscale command and its arguments, e.g. ``["train", "--mesh", "data=8"]``.
      nproc: processes on this machine.
      cpu_devices: simulated CPU devices per process; default ``$NNXSCALE_CPU_DEVICES``,
        else ``8 // nproc`` (at least 1), so that the job has a single process's 8 devices.
      port: coordinator port on 127.0.0.1 for a one-machine job; default: a free port.
      nnodes, node_rank, coordinator: a job over several machines: this machine runs
        processes ``node_rank * nproc`` to ``(node_rank + 1) * nproc - 1`` of
        ``nnodes * nproc``; ``coordinator`` is node 0's ``HOST:PORT``.
      grace: seconds between SIGTERM and SIGKILL when ending the processes.
      log_dir: directory for ``process_<id>.log``; ``None``: no log files.

    Returns:
      0 when every process exited 0; the code of the first failed process (128 + the
      signal number for a death by signal); 130 or 143 after a coordinated stop on SIGINT
      or SIGTERM.

    Raises:
      JobError: bad input, before any process starts (one line each).
    """
    _check(command, nproc, cpu_devices, port, nnodes, node_rank, coordinator, grace)
    if nnodes == 1 and coordinator is None:
        address, bind = f"127.0.0.1:{_free_port(port)}", True
    else:
        JobSpec.from_flags(environ={}, coordinator=coordinator)  # validates HOST:PORT
        address, bind = coordinator, False
        if node_rank == 0:
            _free_port(int(address.rpartition(":")[2]), host="")
    total = nnodes * nproc
    if cpu_devices is None:
        cpu_devices = int(os.environ.get("NNXSCALE_CPU_DEVICES") or max(1, DEFAULT_TOTAL_CPU_DEVICES // nproc))
    ids = [node_rank * nproc + i for i in range(nproc)]
    logs = Path(log_dir) if log_dir is not None else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    where = f"; logs in {logs}/process_<id>.log" if logs is not None else ""
    which = f"process {ids[0]}" if nproc == 1 else f"processes {ids[0]}-{ids[-1]}"
    print(
        f"nnxscale launch: {which} of {total}, {cpu_devices} CPU devices each when there is no accelerator, "
        f"coordinator {address}{where}",
        file=sys.stderr,
        flush=True,
    )
    env = dict(os.environ, **{ENV_COORDINATOR: address, ENV_NUM_PROCESSES: str(total)})
    env["NNXSCALE_CPU_DEVICES"] = str(cpu_devices)
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are written
    if bind:  # a job on this machine only: the coordinator listens on loopback, not on the network
        env["JAX_COORDINATOR_BIND_ADDRESS"] = address
    return _Supervisor(command, ids, env, logs, grace).run()


def _check(command, nproc, cpu_devices, port, nnodes, node_rank, coordinator, grace) -> None:
    if nproc < 1:
        raise JobError(f"-n {nproc}: give the number of processes to start on this machine, at least 1")
    if not command:
        raise JobError("no command: give the nnxscale command after --, e.g. nnxscale launch -n 2 -- train --mesh data=8")
    if command[0] not in COMMANDS:
        raise JobError(
            f"{command[0]!r} is not an nnxscale command that uses devices: launch runs {', '.join(COMMANDS)}, "
            "written without 'nnxscale', e.g. nnxscale launch -n 2 -- train --mesh data=8"
        )
    joined = [a for a in command if a.split("=")[0] in ("--coordinator", "--num-processes", "--process-id")]
    if joined:
        raise JobError(f"the launcher sets {', '.join(joined)} for its processes: remove them from the command")
    if cpu_devices is not None and cpu_devices < 1:
        raise JobError(f"--cpu-devices must be at least 1, got {cpu_devices}")
    if port is not None and not 0 < port < 65536:
        raise JobError(f"--port {port} is not a port: give 1 to 65535, or leave --port out to use a free one")
    if grace < 0:
        raise JobError(f"--grace must be 0 or more seconds, got {grace}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise JobError(f"--node-rank {node_rank} with --nnodes {nnodes}: need 0 <= node rank < nodes")
    if nnodes > 1 and coordinator is None:
        raise JobError(f"--nnodes {nnodes} needs --coordinator HOST:PORT, node 0's address as the other nodes reach it")


def _free_port(port: Optional[int], host: str = "127.0.0.1") -> int:
    """``port`` if nothing listens on it (else JobError), or a free one when ``None``."""
    with socket.socket() as s:
        try:
            s.bind((host, port or 0))
        except OSError as e:
            raise JobError(
                f"port {port} on {host or 'this machine'} is in use ({e.strerror}): give another port, "
                "or leave --port out to use a free one"
            ) from None
        return s.getsockname()[1]


def _ending(code: int) -> str:
    """How a process ended, from its ``returncode``."""
    if code == EXIT_HUNG:
        return f"made no progress for its --hang-timeout (exit code {code})"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    if code == EXIT_PEER_FAILED:
        return f"exited with code {code} (it ended because another process of the job failed)"
    return f"exited with code {code}"


class _Supervisor:
    """Starts the processes, copies their output, and ends them together."""

    def __init__(self, command, ids, env, logs: Optional[Path], grace: float):
        self.command, self.ids, self.env, self.logs, self.grace = command, ids, env, logs, grace
        self.procs: list[subprocess.Popen] = []
        self.codes: dict[int, int] = {}  # index -> returncode, in the order seen
        self.forwarded: Optional[int] = None  # signal forwarded to the processes
        self.failure: Optional[int] = None  # index of the process whose failure ends the job
        self.kill_at: Optional[float] = None  # when SIGKILL follows the SIGTERM already sent
        self.give_up_at: Optional[float] = None
        self.out_lock = threading.Lock()

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        threads = []
        try:
            for pid in self.ids:
                env = dict(self.env, **{ENV_PROCESS_ID: str(pid)})
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "nnxscale", *self.command],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only; it forwards
                        preexec_fn=_die_with_parent,
                    )
                )
            for pid, proc in zip(self.ids, self.procs):
                log = self._open_log(pid)
                for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                    t = threading.Thread(target=self._copy, args=(pid, stream, out, log), daemon=True)
                    t.start()
                    threads.append(t)
            self._supervise()
        finally:
            self._end_all()
            for t in threads:
                t.join(timeout=5)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self._report()

    # -- output ---------------------------------------------------------------------------

    def _open_log(self, pid: int):
        if self.logs is None:
            return None
        log = open(self.logs / f"process_{pid}.log", "ab")
        log.write(f"--- nnxscale {' '.join(self.command)} (process {pid}), {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        return log

    def _copy(self, pid: int, stream, out, log) -> None:
        prefix = f"[{pid}] ".encode()
        for line in iter(stream.readline, b""):
            with self.out_lock:
                if _GLOO_CHATTER not in line:
                    out.buffer.write(prefix + line)
                    out.buffer.flush()
                if log is not None:
                    log.write(line)
                    log.flush()
        stream.close()

    # -- supervision ----------------------------------------------------------------------

    def _on_signal(self, signum, _frame) -> None:
        if self.forwarded is None:
            self.forwarded = signum
            self._signal_all(signum)
        else:  # a second signal: stop waiting for a clean stop
            self._signal_all(signal.SIGKILL)

    def _supervise(self) -> None:
        while len(self.codes) < len(self.procs):
            for i, proc in enumerate(self.procs):
                if i not in self.codes and proc.poll() is not None:
                    self._ended(i, proc.returncode)
            now = time.monotonic()
            if self.kill_at is not None and now >= self.kill_at:
                self._signal_all(signal.SIGKILL)
                self.kill_at = None
            if self.give_up_at is not None and now >= self.give_up_at and self.kill_at is None:
                self._terminate()
                self.give_up_at = None
            time.sleep(_POLL_S)

    def _ended(self, i: int, code: int) -> None:
        self.codes[i] = code
        if code == 0 or self.failure is not None:
            return
        expected = {0, EXIT_PEER_FAILED}
        if self.forwarded is not None:  # the processes were told to stop: they end on that signal
            expected |= {128 + self.forwarded, -self.forwarded}
        else:  # a process stopped on its own signal: the others stop at the same step, shortly
            expected |= {128 + signal.SIGINT, 128 + signal.SIGTERM}
        if code == EXIT_HUNG:  # the others are stuck too: their stacks first, then stop them
            self._signal_all(signal.SIGCONT)
            self._signal_all(signal.SIGUSR1)
            time.sleep(_STACKS_S)
        if code in expected:
            # A process that ended because another failed points at a failure the launcher
            # will see in a moment (or that happened on another machine).
            if self.give_up_at is None:
                self.give_up_at = time.monotonic() + (self.grace if code == EXIT_PEER_FAILED else _STOP_WAIT_S)
            return
        self.failure = i
        self._terminate()

    def _terminate(self) -> None:
        self._signal_all(signal.SIGTERM)
        self.kill_at = time.monotonic() + self.grace
        self.give_up_at = None

    def _signal_all(self, sig: int) -> None:
        for i, proc in enumerate(self.procs):
            if i not in self.codes and proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)  # the process and anything it started
                except ProcessLookupError:
                    pass

    def _end_all(self) -> None:
        """Leave nothing behind, whatever happened (also after an error in the launcher)."""
        if all(p.poll() is not None for p in self.procs):
            return
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(_POLL_S)
        self._signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def _stalled(self, pid: int) -> Optional[str]:
        """The line the stalled process wrote (phase, last progress, where its stacks are)."""
        return _read_stall(self.logs, pid)

    def _report(self) -> int:
        def as_exit(code: int) -> int:
            return 128 - code if code < 0 else code

        blamed = self.failure
        if blamed is None:  # no failure here; a process that ended for another's failure explains the end
            blamed = next((i for i, c in self.codes.items() if c == EXIT_PEER_FAILED and self.forwarded is None), None)
        if blamed is not None:
            stalled = self._stalled(self.ids[blamed]) if self.codes[blamed] == EXIT_HUNG else None
            what = f": {stalled}" if stalled else ""
            print(
                f"nnxscale launch: process {self.ids[blamed]} {_ending(self.codes[blamed])}{what}; the job is stopped "
                "(re-run the same command to resume from the last complete checkpoint)",
                file=sys.stderr,
                flush=True,
            )
            return as_exit(self.codes[blamed]) or 1
        if self.forwarded is not None and any(self.codes.values()):
            return 128 + self.forwarded
        return next((as_exit(c) for c in self.codes.values() if c), 0)


def _read_stall(logs: Optional[Path], pid: int) -> Optional[str]:
    if logs is None:
        return None
    try:
        return (logs / f"hang_{pid}.txt").read_text().strip() or None
    except OSError:
        return None


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL if the launcher dies (Linux), so none is left behind."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
