"""Many processes, one job: joining it through ``jax.distributed``, stopping together, failing fast.

**Joining** (:func:`join`), first match wins:

1. explicit: ``--coordinator HOST:PORT --num-processes N --process-id I``, or the environment
   variables ``NNXSCALE_COORDINATOR``, ``NNXSCALE_NUM_PROCESSES``, ``NNXSCALE_PROCESS_ID``
   with the same meaning (a flag wins over its variable; ``nnxscale launch`` sets the
   variables for the processes it starts). ``--num-processes 1`` is a single process.
2. detected: a cluster environment JAX itself recognizes (SLURM, Open MPI, Cloud TPU,
   Kubernetes indexed jobs) that holds more than one process; JAX reads the coordinator,
   the process count and this process's id from it, and explicit values override.
3. otherwise a single process, and nothing is initialized: exactly as without this module.

Every process calls ``jax.distributed.initialize``; process 0 hosts JAX's coordination
service. On CPU the collectives between processes are gloo (JAX's default) and each
process has ``--cpu-devices`` devices, so the job has ``N x --cpu-devices``.

**Timeouts** (seconds; ``--heartbeat-timeout`` etc., or ``NNXSCALE_HEARTBEAT_TIMEOUT``,
``NNXSCALE_INIT_TIMEOUT``, ``NNXSCALE_SHUTDOWN_TIMEOUT``), chosen so that a broken job
ends in seconds rather than JAX's minutes:

- heartbeat, 10 (JAX: 100): a process whose heartbeats stop this long is dead, and JAX
  aborts every other process (measured on loopback: a survivor of a ``kill -9`` aborts
  7-10 s after the kill, 96 s with JAX's default).
- init, 120 (JAX: 300): how long the processes wait for each other to join; after it,
  each says which job it could not join and exits with code 2.
- shutdown, 30 (JAX: 300): how long a process that has finished waits at exit for the
  others.

**Stopping together** (:class:`StopVote`): a SIGTERM or SIGINT reaches one process (or
all, at different moments), but a collective save needs every process at the same step.
Each step every process contributes its own flag to a one-integer all-reduce inside the
training step and reads the result a few steps later, so all of them see the same answer
at the same step.

**Failing fast** (:func:`leave`): a process that fails (an exception, an error of ours,
an uncoordinated Ctrl-C) writes one key in JAX's coordination service and exits at once,
skipping JAX's shutdown barrier (the others may be blocked in a collective it will never
join, and the barrier would wait out its timeout). Every process watches that key from a
thread, and on seeing it says which process failed and why, and exits with
:data:`EXIT_PEER_FAILED`. A process that dies without a word (``kill -9``, a crash) is
found by JAX's heartbeat instead, which aborts the others with its own message after the
heartbeat timeout; ``nnxscale launch`` notices the death at once and names the process.

jax is imported inside the functions that need it: ``nnxscale launch`` shares this
module's names without starting jax.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Optional

from nnxscale.errors import JobError
from nnxscale.jobs import jax_private

#: Environment variables with the meaning of the flags of the same name.
ENV_COORDINATOR = "NNXSCALE_COORDINATOR"
ENV_NUM_PROCESSES = "NNXSCALE_NUM_PROCESSES"
ENV_PROCESS_ID = "NNXSCALE_PROCESS_ID"
ENV_HEARTBEAT_TIMEOUT = "NNXSCALE_HEARTBEAT_TIMEOUT"
ENV_INIT_TIMEOUT = "NNXSCALE_INIT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "NNXSCALE_SHUTDOWN_TIMEOUT"

#: Exit code of a process that ended because another process of its job failed.
EXIT_PEER_FAILED = 3

_FAILED_KEY = "nnxscale/failed"  # coordination-service key: the first failure, as JSON
_FAILED_BARRIER = "nnxscale/failure_seen"
_HOSTS_KEY = "nnxscale/hosts"  # one key per process: its host name
_ACK_TIMEOUT_MS = 5_000  # a failing process waits this long for the others to read its failure
_WATCH_MS = 200  # the watchdog's wait per request for the failure key
_JAX_INIT_MARGIN_S = 10  # JAX's own initialization deadline comes this much after ours


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """How to join a job, as given (flags over environment); ``None`` where not given.

    Timeouts are whole seconds (see the module docstring for the defaults and why).
    """

    coordinator: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    heartbeat_timeout: int = 10
    init_timeout: int = 120
    shutdown_timeout: int = 30

    @classmethod
    def from_flags(cls, environ: Mapping[str, str] = os.environ, **flags) -> JobSpec:
        """Build from flag values (``None``: not given), falling back to ``environ``.

        Raises :class:`JobError` for a value that is not an integer, a coordinator that is
        not ``HOST:PORT``, a count below 1, an id outside ``[0, count)`` or a timeout below 1.
        """
        sources = {
            "coordinator": ("--coordinator", ENV_COORDINATOR, str),
            "num_processes": ("--num-processes", ENV_NUM_PROCESSES, int),
            "process_id": ("--process-id", ENV_PROCESS_ID, int),
            "heartbeat_timeout": ("--heartbeat-timeout", ENV_HEARTBEAT_TIMEOUT, int),
            "init_timeout": ("--init-timeout", ENV_INIT_TIMEOUT, int),
            "shutdown_timeout": ("--shutdown-timeout", ENV_SHUTDOWN_TIMEOUT, int),
        }
        values = {}
        for field, (flag, var, kind) in sources.items():
            value = flags.get(field)
            if value is None and environ.get(var, "").strip():
                text = environ[var].strip()
                try:
                    value = kind(text)
                except ValueError:
                    raise JobError(f"{var}={text!r} is not an integer (it means {flag})") from None
            if value is not None:
                values[field] = value
        spec = cls(**values)
        spec._check()
        return spec

    def _check(self) -> None:
        for name, flag in (("heartbeat_timeout", "--heartbeat-timeout"), ("init_timeout", "--init-timeout"),
                           ("shutdown_timeout", "--shutdown-timeout")):  # fmt: skip
            if getattr(self, name) < 1:
                raise JobError(f"{flag} must be at least 1 second, got {getattr(self, name)}")
        if self.num_processes is not None and self.num_processes < 1:
            raise JobError(f"--num-processes must be at least 1, got {self.num_processes}")
        if self.process_id is not None and (
            self.process_id < 0 or (self.num_processes is not None and self.process_id >= self.num_processes)
        ):
            count = f" of a job of {self.num_processes}" if self.num_processes is not None else ""
            raise JobError(f"--process-id {self.process_id} is not a process{count}: ids are 0 to --num-processes - 1")
        if self.coordinator is not None:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise JobError(
                    f"--coordinator {self.coordinator!r} is not HOST:PORT: give process 0's address and a free "
                    "port, e.g. 10.0.0.1:8476"
                )


@dataclasses.dataclass(frozen=True)
class Job:
    """The job this process belongs to (a job of one process when nothing was joined)."""

    process_id: int = 0
    num_processes: int = 1
    coordinator: Optional[str] = None
    source: str = "single process"  # "flags or environment", or the cluster JAX detected ("SlurmCluster", ...)
    hosts: tuple[str, ...] = ()  # host name of each process, by process id (empty for a single process)

    @property
    def is_multiprocess(self) -> bool:
        return self.num_processes > 1


_job = Job()
_watchdog: Optional[_Watchdog] = None
_stacks = None  # an open file: where the watchdog writes this process's stacks on a peer's failure


def stacks_on_peer_failure(file) -> None:
    """When another process fails, write every thread's stacks to ``file`` (an open text
    file; ``None``: don't) before ending this one: set by the trainer's progress watchdog."""
    global _stacks
    _stacks = file
_leaving = threading.Lock()  # taken by whichever of leave() and the watchdog ends the process


def current() -> Job:
    """The job joined by :func:`join` (a single process before, or when nothing was joined)."""
    return _job


def join(spec: JobSpec = JobSpec()) -> Job:
    """Join the job ``spec`` describes (see the module docstring), or stay a single process.

    Must run before jax starts its backends (before ``jax.devices()`` or any computation).
    A process joins once: later calls return the job already joined. Raises
    :class:`JobError` when the explicit values are incomplete (e.g. a coordinator but no
    process id) and no cluster environment supplies the rest, or when process 0 cannot
    listen on the coordinator's port. If not every process has joined after
    ``spec.init_timeout`` seconds, prints which job could not be joined and exits with
    code 2.
    """
    global _job, _watchdog
    import jax  # jax: not while the CLI starts

    if _job.is_multiprocess or spec.num_processes == 1:
        return _job
    explicit = {"--coordinator": spec.coordinator, "--num-processes": spec.num_processes,
                "--process-id": spec.process_id}  # fmt: skip
    cluster = None
    if None in explicit.values():
        cluster = _detected_cluster()
        if cluster is None and any(v is not None for v in explicit.values()):
            missing = " and ".join(flag for flag, v in explicit.items() if v is None)
            raise JobError(
                f"a job of several processes needs --coordinator, --num-processes and --process-id; {missing} "
                f"missing (flags, or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}); no cluster "
                "environment (SLURM, Open MPI, Cloud TPU, Kubernetes) was found to supply it"
            )
        if cluster is None or _cluster_size(cluster) <= 1:
            return _job
    # JAX's preemption service catches SIGTERM in C++ and only records it, so a SIGTERM
    # before the training loop installs its handler would be swallowed; StopVote does the
    # coordinated stop instead.
    jax.config.update("jax_enable_preemption_service", False)
    where = spec.coordinator or "the coordinator of the detected cluster"
    watch = _InitDeadline(spec, where)
    try:
        jax.distributed.initialize(
            spec.coordinator,
            spec.num_processes,
            spec.process_id,
            initialization_timeout=spec.init_timeout + _JAX_INIT_MARGIN_S,
            heartbeat_timeout_seconds=spec.heartbeat_timeout,
            shutdown_timeout_seconds=spec.shutdown_timeout,
        )
    except Exception as e:  # e.g. process 0 cannot listen on the port ("Failed to start RPC server")
        hint = (
            ": process 0 listens on the port of --coordinator, which may be in use here; choose another port"
            if spec.process_id == 0
            else ""
        )
        raise JobError(f"could not join the job at {where} ({type(e).__name__}: {str(e).strip()}){hint}") from None
    finally:
        watch.cancel()
    _no_persistent_cache_in_a_cpu_job()
    client = jax_private.distributed_client()
    _job = Job(
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        coordinator=spec.coordinator,
        source=cluster.__name__ if cluster is not None else "flags or environment",
        hosts=_host_names(client, jax.process_index(), spec.init_timeout),
    )
    _watchdog = _Watchdog(client, _job)
    _watchdog.start()
    atexit.register(_watchdog.stop)  # runs before JAX's own atexit shutdown (registered earlier)
    return _job


#: Whether this process turned the persistent cache off (a CPU job): see
#: :func:`cache_without_collectives`.
_cache_turned_off = False


def _no_persistent_cache_in_a_cpu_job() -> None:
    """Turn JAX's persistent compilation cache off in a CPU job of several processes.

    When one process of a CPU job runs an executable read from the cache and its peer one it
    has just compiled, their gloo collectives go out of step ("Received data size doesn't
    match expected size (48 vs 4)") or hang in the first step. JAX writes entries from
    process 0 only and lets every process read them, and process 0's entry (from an earlier
    job) need not match process 1's fresh compilation. A cache per process, each writing its
    own entries, hangs the next job in gloo's context initialization although every process
    loads only executables it compiled itself (2 x 4 devices, gpt2-tiny); and
    ``JAX_SHARE_BINARY_BETWEEN_HOSTS`` (one process compiles, the others receive its
    executable) fails the same way (docs/multiprocess.md). Programs compiled in the same job always
    match, so a CPU job compiles every program with collectives itself (programs without any
    may use the cache: :func:`cache_without_collectives`). GPU and TPU jobs keep the cache,
    as JAX intends.
    """
    global _cache_turned_off
    import jax  # jax: not while the CLI starts

    if jax.process_count() == 1 or jax.default_backend() != "cpu" or not jax.config.jax_enable_compilation_cache:
        return
    if jax.config.jax_compilation_cache_dir:
        _set_persistent_cache(False)
        _cache_turned_off = True


def _set_persistent_cache(on: bool) -> None:
    import jax  # jax: not while the CLI starts

    jax.config.update("jax_enable_compilation_cache", on)
    jax_private.reset_compilation_cache()  # it remembers whether it is in use once asked


@contextlib.contextmanager
def cache_without_collectives():
    """Within the block, a CPU job's processes use the persistent compilation cache again:
    for programs that run no collective (the sharded init: every device draws its own
    shards), where a process's executable cannot go out of step with its peers'. A job's
    init then compiles once per cache instead of once per process and job (7 to 9 s of a
    2 x 4-device job's start on 2 cores). Yields whether the cache was
    turned on: the caller compiles again outside the block a program that turns out to run
    collectives. Elsewhere it does nothing and yields False."""
    if not _cache_turned_off:
        yield False
        return
    _set_persistent_cache(True)
    try:
        yield True
    finally:
        _set_persistent_cache(False)


def _host_names(client, process_id: int, timeout_s: int) -> tuple[str, ...]:
    """Every process's host name, by process id, through the coordination service.

    Processes are not hosts: under SLURM or Open MPI JAX runs one process per GPU, and the
    processes of one host share its fast links (see ``mesh.process_findings``).
    """
    client.key_value_set(f"{_HOSTS_KEY}/{process_id}", socket.gethostname())
    client.wait_at_barrier(_HOSTS_KEY, timeout_s * 1000)
    names = dict(client.key_value_dir_get(f"{_HOSTS_KEY}/"))
    return tuple(names[f"{_HOSTS_KEY}/{i}"] for i in range(len(names)))


def _detected_cluster():
    """The cluster environment JAX would bootstrap from, or ``None`` (mpi4py is opt-in in JAX too)."""
    for env in jax_private.cluster_types():  # JAX's own detection; no public API lists it
        if not env.opt_in_only_method and env.is_env_present():
            return env
    return None


def _cluster_size(cluster) -> int:
    try:
        return int(cluster.get_process_count())
    except Exception as e:  # e.g. a Kubernetes pod that is not part of an indexed job
        raise JobError(
            f"found a {cluster.__name__} environment but could not read its number of processes ({e}): "
            f"give --num-processes (1 for a single process), --process-id and --coordinator"
        ) from None




class _InitDeadline:
    """Ends this process with a message of ours if joining takes longer than allowed.

    JAX's own deadline (set ``_JAX_INIT_MARGIN_S`` later) aborts with a C++ log line that
    names neither the job nor what to check.
    """

    def __init__(self, spec: JobSpec, where: str):
        self.spec, self.where = spec, where
        self.timer = threading.Timer(spec.init_timeout, self._expired)
        self.timer.daemon = True
        self.timer.start()

    def _expired(self) -> None:
        s = self.spec
        who = f"process {s.process_id} of {s.num_processes}" if s.num_processes else "this process"
        _say(
            f"nnxscale: error: {who} could not join the job at {self.where} within --init-timeout "
            f"{s.init_timeout} s: not every process connected. Start all {s.num_processes or 'N'} processes "
            "with the same --coordinator (process 0's address, reachable from every host) and --num-processes, "
            "each with its own --process-id"
        )
        os._exit(2)

    def cancel(self) -> None:
        self.timer.cancel()


# --------------------------------------------------------------------------------------
# Stopping together
# --------------------------------------------------------------------------------------


class StopVote:
    """Whether to stop, agreed by every process of the job at the same step.

    A SIGTERM or SIGINT may reach one process only, or all at different moments, but a
    collective save needs every process at the same step. Each step, every process puts
    its own request (a signal number, or 0) on each of its devices with :meth:`ballot`, and
    the training step itself reduces the ballots (``jnp.max``, :meth:`reduce`): the
    all-reduce is part of the step's program, ordered with the step's own collectives on
    every device. A separate vote program would not be: on XLA:CPU two independent
    programs with cross-process collectives can start in different orders on different
    devices and wait for each other forever. The trainer reads the result with the step's
    metrics, a few steps later, so the host never waits for it.

    ``needed`` is false in a single process, where a request is the answer at once.

    Calling the vote (``vote(request, final=...)``, the API before the vote moved into
    the step) runs it as its own program and waits for it: use it only when no other
    program with collectives is in flight.
    """

    def __init__(self, mesh=None, lag: int = 2):
        import jax  # jax: not while the CLI starts

        self.lag = lag
        self.needed = jax.process_count() > 1
        self._pending: collections.deque = collections.deque()
        if not self.needed:
            return
        if mesh is None:
            import numpy as np  # jax: not while the CLI starts
            from jax.sharding import Mesh  # jax: not while the CLI starts

            mesh = Mesh(np.array(jax.devices()), ("devices",))
        self._sharding = self.sharding(mesh)
        self._shape = (mesh.size,)
        self._max = None

    @staticmethod
    def sharding(mesh):
        """Where the ballots live: one int32 per device of ``mesh``."""
        from jax.sharding import NamedSharding  # jax: not while the CLI starts
        from jax.sharding import PartitionSpec as P  # jax: not while the CLI starts

        return NamedSharding(mesh, P(tuple(mesh.axis_names)))

    def ballot(self, request: Optional[int]):
        """This process's request (``None``: carry on) on each of its devices, as the step's input."""
        import jax  # jax: not while the CLI starts
        import numpy as np  # jax: not while the CLI starts

        flag = np.full((1,), request or 0, np.int32)
        return jax.make_array_from_callback(self._shape, self._sharding, lambda _: flag)

    @staticmethod
    def reduce(ballots):
        """Inside the step: the agreed request, the largest signal number (0: carry on)."""
        import jax.numpy as jnp  # jax: not while the CLI starts

        return jnp.max(ballots)

    def __call__(self, request: Optional[int], *, final: bool = False) -> Optional[int]:
        if not self.needed:
            return request
        import jax  # jax: not while the CLI starts
        from jax.sharding import NamedSharding  # jax: not while the CLI starts
        from jax.sharding import PartitionSpec as P  # jax: not while the CLI starts

        if self._max is None:
            self._max = jax.jit(self.reduce, out_shardings=NamedSharding(self._sharding.mesh, P()))
        agreed = int(self._max(self.ballot(request)))  # waits: no other collective may be in flight
        self._pending.append(agreed)
        while len(self._pending) > (0 if final else self.lag):
            value = self._pending.popleft()
            if value:
                self._pending.clear()
                return value
        return None


# --------------------------------------------------------------------------------------
# Failing fast
# --------------------------------------------------------------------------------------


def leave(code: int, reason: str) -> int:
    """End this process after a failure; in a job, tell the others first.

    Single process: returns ``code`` (the caller exits as usual). In a job of several
    processes: records ``reason`` in JAX's coordination service (the first failure wins),
    waits up to 5 s for the other processes to read it, and exits at once with ``code``,
    without JAX's shutdown barrier. Never returns there.
    """
    job = _job
    if not job.is_multiprocess:
        return code
    if not _leaving.acquire(blocking=False):  # the watchdog is already ending this process
        while True:
            time.sleep(1)
    client = jax_private.distributed_client()
    failure = json.dumps({"process": job.process_id, "code": code, "reason": reason})
    try:
        client.key_value_set(_FAILED_KEY, failure)
    except Exception as e:
        if "ALREADY_EXISTS" not in str(e):  # not just another process having failed first: say so
            _say(f"nnxscale: error: process {job.process_id} could not tell the other processes of its failure "
                 f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); they end when their "
                 "heartbeat to the coordinator times out (--heartbeat-timeout)")  # fmt: skip
    _acknowledge(client)
    _exit(code)


class _Watchdog(threading.Thread):
    """Waits for a failure recorded by another process; then reports it and exits."""

    def __init__(self, client, job: Job):
        super().__init__(name="nnxscale-job-watchdog", daemon=True)
        self.client, self.job = client, job
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.is_set():
            started = time.monotonic()
            try:
                failure = json.loads(self.client.blocking_key_value_get(_FAILED_KEY, _WATCH_MS))
            except Exception:  # nothing recorded yet; or the service is gone, which JAX reports itself
                self._stopped.wait(max(0.0, _WATCH_MS / 1000 - (time.monotonic() - started)))
                continue
            if failure["process"] == self.job.process_id or not _leaving.acquire(blocking=False):
                return  # this process's own failure: leave() is handling it
            _say(
                f"nnxscale: error: process {failure['process']} of {self.job.num_processes} failed "
                f"({failure['reason']}); ending process {self.job.process_id} too. Re-run the same command "
                "to resume from the last complete checkpoint"
            )
            _dump_stacks(f"process {failure['process']} failed: {failure['reason']}")
            _acknowledge(self.client)
            _exit(EXIT_PEER_FAILED)

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=2 * _WATCH_MS / 1000)


def _dump_stacks(why: str) -> None:
    stacks = _stacks
    if stacks is None:
        return
    try:
        stacks.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {why}\n")
        stacks.flush()
        faulthandler.dump_traceback(stacks, all_threads=True)
        stacks.flush()
    except (OSError, ValueError):  # a closed or unwritable file: the stacks are a courtesy
        pass


def _acknowledge(client) -> None:
    """Every live process passes this barrier once it knows of the failure (5 s at most)."""
    try:
        client.wait_at_barrier(_FAILED_BARRIER, _ACK_TIMEOUT_MS)
    except Exception:  # a process that is gone never arrives: the timeout is the bound
        pass


def _say(line: str) -> None:
    try:
        sys.stdout.flush()
    except Exception:
        pass
    print(line, file=sys.stderr, flush=True)


def _exit(code: int):
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
