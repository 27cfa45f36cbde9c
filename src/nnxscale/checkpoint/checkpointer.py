"""Sharded checkpoints with Orbax: asynchronous saves, exact resume, restore onto any mesh.

A checkpoint is two items, written by one ``orbax.checkpoint.CheckpointManager``::

    run_dir/checkpoints/
      300/                        a finalized step
        state/                    the array state: each process writes its own shards
        extras/metadata           the JSON extras: data iterator state, run config
        checksums/process_<i>.json  each process's part of every array's checksum
                                  (nnxscale.checkpoint.integrity); their sum is the checksum
      400.orbax-checkpoint-tmp/   a save in progress, or one killed mid-way: never listed
      200.damaged/                a step whose data failed its checksum, set aside

Orbax writes each step into ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>``
once every process has written its shards (on GCS a ``commit_success.txt`` file marks
completion instead of the rename). ``CheckpointManager.latest_step()`` in orbax 0.12.8
reports a step as soon as ``save()`` returns, before that rename, so :meth:`steps` here
lists only steps that are finalized on disk.

Restore reads into the layout of the *target*: each device reads just the slices of the
saved chunks that its shard of the target needs, so moving from ``data=8`` to
``data=2,model=4`` never gathers a whole array anywhere. Every process must call
:meth:`Checkpointer.save`, :meth:`~Checkpointer.restore`, :meth:`~Checkpointer.wait` and
:meth:`~Checkpointer.close` (orbax synchronizes the processes inside them).

Integrity: :meth:`Checkpointer.save` records a checksum of every array, computed on the
devices that hold it (:mod:`nnxscale.checkpoint.integrity`: the same value on any mesh), and
:meth:`Checkpointer.restore` recomputes it on the restored arrays: damaged data raises
:class:`DamagedCheckpointError` naming the step instead of restoring garbage.
:meth:`Checkpointer.restore_intact` falls back to the newest step that is intact.
The checksum programs are dispatched by ``save`` and awaited in Orbax's background
commit, so the training loop does not wait for them, and the step is finalized only once
every process has written its part. Checkpoints saved before checksums existed restore
unverified; those with the checksums inside their extras (nnxscale before the
``checksums`` item) are verified as before.

Many processes: every barrier here and in Orbax goes through JAX's coordination service,
never through a device collective (Orbax's default barrier is an all-gather over every
device, run from its background threads). A program with cross-process collectives that
is not ordered after the training step can start in a different order on different
devices and deadlock the job (see docs/multiprocess.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import logging
import operator
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError

from nnxscale.checkpoint import integrity as integrity
from nnxscale.errors import CheckpointError, DamagedCheckpointError, os_reason
from nnxscale.jobs import jax_private
from nnxscale.jobs.process import owns_process

_STATE = "state"
_EXTRAS = "extras"
_CHECKSUM_ITEM = "checksums"
#: Key of the checksums inside the extras item (written before the checksums item existed).
_CHECKSUMS = "nnxscale.checksums"
#: Suffix of a step directory set aside as damaged: ``<step>.damaged``.
DAMAGED_SUFFIX = ".damaged"


@dataclasses.dataclass
class _PendingChecksums:
    """Checksums dispatched by ``save``, resolved in Orbax's background commit."""

    paths: list[str]
    partials: list  # one (devices, 2) uint32 jax.Array per array, maybe still computing

    def resolve(self) -> dict:
        """This process's part of each checksum (blocks until the devices are done)."""
        sums = integrity.to_hex(integrity.local_sums(self.partials))
        return {
            "algorithm": integrity.ALGORITHM,
            "process": jax.process_index(),
            "processes": jax.process_count(),
            "arrays": dict(zip(self.paths, sums)),
        }


@dataclasses.dataclass
class _ChecksumSave(ocp.args.CheckpointArgs):
    pending: _PendingChecksums


@dataclasses.dataclass
class _ChecksumRestore(ocp.args.CheckpointArgs):
    pass


class ChecksumFilesDamaged(ValueError):
    """A step's checksum files are missing or do not agree with each other: damage."""


class _ChecksumHandler(ocp.handlers.AsyncCheckpointHandler):
    """The ``checksums`` item: every process writes ``process_<i>.json``, its part of each sum.

    The write waits for the checksum programs in Orbax's commit thread, so ``save``
    returns without waiting for them; Orbax finalizes the step only after every process's
    commit, so a finalized step always has all its parts.
    """

    async def async_save(self, directory: epath.Path, args: _ChecksumSave):
        return [ocp.future.CommitFutureAwaitingContractedSignals(self._write(directory, args.pending),
                                                                 name="nnxscale_checksums")]  # fmt: skip

    async def _write(self, directory: epath.Path, pending: _PendingChecksums) -> None:
        self.save(directory, _ChecksumSave(pending))

    def save(self, directory: epath.Path, args: _ChecksumSave) -> None:
        record = args.pending.resolve()
        (directory / f"process_{record['process']}.json").write_text(json.dumps(record))

    def restore(self, directory: epath.Path, args: Optional[_ChecksumRestore] = None) -> dict:
        """``{"algorithm", "arrays": {path: checksum}}``: every process's part, added up."""
        records = [json.loads(f.read_text()) for f in sorted(directory.glob("process_*.json"))]
        if not records:
            raise ChecksumFilesDamaged(f"no process_<i>.json in {directory}")
        expected = records[0]["processes"]
        found = sorted(r["process"] for r in records)
        if found != list(range(expected)):
            missing = sorted(set(range(expected)) - set(found))
            raise ChecksumFilesDamaged(f"the checksums of process {missing[0] if missing else '?'} of {expected} are missing")
        paths = list(records[0]["arrays"])
        if any(list(r["arrays"]) != paths or r["algorithm"] != records[0]["algorithm"] for r in records):
            raise ChecksumFilesDamaged("the processes' checksum files list different arrays")
        total = integrity.add([integrity.from_hex(list(r["arrays"].values())) for r in records])
        return {"algorithm": records[0]["algorithm"], "arrays": dict(zip(paths, integrity.to_hex(total)))}

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


def checkpoint_dir(run_dir) -> Path:
    """Where a run keeps its checkpoints: ``run_dir/checkpoints``."""
    return Path(run_dir) / "checkpoints"


class _StateHandler(ocp.StandardCheckpointHandler):
    """Orbax's handler for the state, writing each replicated array from one replica on CPU.

    Orbax splits the write of an array that several devices hold whole over those replicas
    ("replica-parallel"), compiling a slice program per replica and shape: 80 programs and
    about 4 s at the first save of gpt2-tiny on ``data=8``, in every process of a job. CPU
    devices share one host memory, so the split buys nothing there. The files are the same
    either way, so checkpoints move freely between the two. GPU and TPU keep Orbax's default.
    Two Orbax internals are used: this handler's ``_impl`` and the array handler's
    ``_use_replica_parallel``; where either is missing, Orbax's default stays.
    """

    def __init__(self, *, multiprocessing_options: ocp.options.MultiprocessingOptions):
        super().__init__(multiprocessing_options=multiprocessing_options)
        registry = _one_replica_registry() if jax.default_backend() == "cpu" else None
        if registry is not None and isinstance(getattr(self, "_impl", None), ocp.PyTreeCheckpointHandler):
            self._impl = ocp.PyTreeCheckpointHandler(
                save_concurrent_gb=96, restore_concurrent_gb=96,  # StandardCheckpointHandler's own defaults
                multiprocessing_options=multiprocessing_options, type_handler_registry=registry,
            )  # fmt: skip


def _one_replica_registry():
    """Orbax's standard type handlers with a copy of its array handler that does not split
    replicated arrays; ``None`` where this Orbax has no such setting to change."""
    arrays = copy.copy(ocp.type_handlers.get_type_handler(jax.Array))
    if not hasattr(arrays, "_use_replica_parallel"):
        return None
    arrays._use_replica_parallel = False
    handlers = [(ty, ocp.type_handlers.get_type_handler(ty)) for ty in ocp.type_handlers.supported_types()]
    return ocp.type_handlers.create_type_handler_registry(
        *[(ty, arrays if ty is jax.Array else handler) for ty, handler in handlers]
    )


class Checkpointer:
    """Save and restore ``(state, extras)`` by step, keeping the newest ``keep`` steps.

    ``state`` is a pytree of (sharded) ``jax.Array``: parameters, optimizer state, the step
    counter, RNG key data. ``extras`` is a JSON-able dict, returned as JSON gives it back
    (tuples become lists, dict keys strings). Usable as a context manager, which closes.

    Args:
      directory: the checkpoint root, usually :func:`checkpoint_dir` of the run; created
        if missing.
      keep: how many of the newest checkpoints to keep; older ones are deleted once a newer
        save has finished.
      async_save: write in background threads (``save`` returns once the arrays are copied
        to host memory); ``False`` makes ``save`` return only when the step is on disk.
      remove_unfinished: delete the unfinished saves (``<step>.orbax-checkpoint-tmp``) that
        a crash left behind, freeing their space. Only for the one writer of the directory
        (a trainer holding the run's lock): another writer's save in progress looks the same.
    """

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True, remove_unfinished: bool = False):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint")
        self.keep = keep
        text = os.fspath(directory)
        self.directory = epath.Path(text if "://" in text else os.path.abspath(os.path.expanduser(text)))

        # Barriers through JAX's coordination service: Orbax's default for a job of several
        # processes is a device all-gather (sync_global_devices), which, run from its
        # background threads while training steps are in flight, can deadlock the job.
        # Naming the processes (all of them) selects the coordination-service barrier.
        processes = set(range(jax.process_count())) if jax.process_count() > 1 else None
        multiprocessing = ocp.options.MultiprocessingOptions(active_processes=processes)
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        state_handler = _StateHandler(multiprocessing_options=multiprocessing)
        extras_handler = ocp.JsonCheckpointHandler(multiprocessing_options=multiprocessing)
        checksum_handler = _ChecksumHandler()
        registry.add(_STATE, ocp.args.StandardSave, state_handler)
        registry.add(_STATE, ocp.args.StandardRestore, state_handler)
        if isinstance(getattr(state_handler, "_impl", None), ocp.PyTreeCheckpointHandler):  # a part of the state
            registry.add(_STATE, ocp.args.PyTreeRestore, state_handler._impl)
        registry.add(_EXTRAS, ocp.args.JsonSave, extras_handler)
        registry.add(_EXTRAS, ocp.args.JsonRestore, extras_handler)
        registry.add(_CHECKSUM_ITEM, _ChecksumSave, checksum_handler)
        registry.add(_CHECKSUM_ITEM, _ChecksumRestore, checksum_handler)
        if processes is not None:  # Orbax creates the directory only without active_processes
            self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=remove_unfinished,
            multiprocessing_options=multiprocessing,
            create=processes is None,
        )
        # The command holds back the echoes of a failed save or restore, which it reports itself: while a
        # save is in flight (from save() until wait() sees it succeed, or close()), and after a failed
        # restore for the rest of the command. A library call leaves logging alone.
        self._quiet = owns_process()
        self._holding = False
        self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        # The manager's own step naming (no prefix, no padding), used to list finalized steps.
        self._names = ocp.step.standard_name_format()
        self._pending: Optional[int] = None
        self._closed = False

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: int, state, extras: dict, *, force: bool = False) -> bool:
        """Start saving ``state`` and ``extras`` as ``step``; returns whether a save started.

        Returns ``False`` (and writes nothing) when ``step`` is not newer than the latest
        checkpoint, unless ``force``. Before this returns, every array's checksum program
        is dispatched and the arrays are copied to host memory, so the caller may donate or
        overwrite them at once (JAX runs the checksum's reads first); the checksums and the
        write complete in the background until :meth:`wait` (or the next ``save``, which
        waits first). The step is listed by :meth:`steps` only once it is complete on disk,
        checksums included.

        Raises :class:`CheckpointError` if ``step`` already has a checkpoint (it is never
        overwritten) or if the previous asynchronous save failed.
        """
        try:
            step = operator.index(step)  # also numpy and concrete jax integer scalars
        except TypeError:
            step = None
        if step is None or isinstance(step, bool) or step < 0:
            raise ValueError(f"checkpoint step must be a non-negative integer, got {step!r}")
        if not isinstance(extras, Mapping):
            raise TypeError(f"extras must be a dict of JSON-able values, got {type(extras).__name__}")
        if _CHECKSUMS in extras:
            raise ValueError(f"extras key {_CHECKSUMS!r} is reserved for the checkpoint's own checksums")
        try:
            json.dumps(extras)
        except (TypeError, ValueError) as e:
            # Checked here: in the background thread the same error would surface a save later.
            raise TypeError(f"extras for step {step} are not JSON-serializable: {e}") from None

        self.wait()
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        pending = _PendingChecksums(
            paths=[_key_text(p) for p, _ in leaves], partials=integrity.partial_sums([leaf for _, leaf in leaves])
        )
        args = ocp.args.Composite(
            **{_STATE: ocp.args.StandardSave(state), _EXTRAS: ocp.args.JsonSave(dict(extras)),
               _CHECKSUM_ITEM: _ChecksumSave(pending)}  # fmt: skip
        )
        self._hold_echoes(True)
        try:
            started = self._manager.save(step, args=args, force=force)
        except StepAlreadyExistsError:
            self._hold_echoes(False)
            raise CheckpointError(
                f"step {step} already has a checkpoint at {self._step_dir(step)}, which is never "
                "overwritten: save under a new step, or move that directory aside if it is damaged"
            ) from None
        except Exception as e:  # with async_save=False the whole write happens in here
            raise self._save_failed(step, e) from e
        if started:
            self._pending = step
        else:
            self._hold_echoes(False)
        return started

    def _hold_echoes(self, hold: bool) -> None:
        """Hold back (or again let through) the echoes of a failed save (:class:`_QuietOrbaxErrors`)."""
        if self._quiet and hold != self._holding:
            (_quiet_orbax_errors.acquire if hold else _quiet_orbax_errors.release)()
            self._holding = hold

    def wait(self) -> None:
        """Block until the pending save, if any, is complete on disk.

        Raises :class:`CheckpointError` naming the step if that save failed; its unfinished
        directory is left in place and ignored by :meth:`steps` and :meth:`restore`.
        """
        pending, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # its echoes may go on until close()
            raise self._save_failed(pending, e) from e
        self._hold_echoes(False)

    def close(self) -> None:
        """Wait for the pending save, then release orbax's threads and files."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            try:
                self._manager.close()
            finally:
                self._hold_echoes(False)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- listing --------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first.

        Excludes a save still in progress and old steps already due for deletion. While a
        save is in progress processes may briefly disagree; :meth:`wait` first where every
        process must see the same list.
        """
        finalized = {m.step for m in self._names.find_all(self.directory)}
        return sorted(s for s in self._manager.all_steps() if s in finalized)

    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint's step, or ``None`` if there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    # -- restoring ------------------------------------------------------------------------

    def restore(self, target, *, step: Optional[int] = None, warn: Optional[Callable[[str], None]] = None,
                part: bool = False) -> tuple[Any, dict]:  # fmt: skip
        """Read checkpoint ``step`` (default: the latest) into the layout of ``target``.

        Args:
          target: the state's pytree with a ``jax.ShapeDtypeStruct(shape, dtype,
            sharding=NamedSharding(mesh, spec))`` per array, for this run's mesh and rules
            (e.g. built from ``nnx.eval_shape``). A ``jax.Array`` leaf stands for its own
            shape, dtype and sharding. The restored arrays take the target's sharding,
            whatever mesh the checkpoint was saved from.
          step: which checkpoint; ``None`` for the latest complete one.
          part: ``target`` is a part of the saved state (e.g. ``{"params": ...}`` of a train
            state): only its arrays are read (and verified); the rest stays on disk.

        Returns:
          ``(state, extras)``: ``state`` with the structure of ``target``.

        Raises:
          CheckpointError: no complete checkpoint (or none for ``step``); or the target's
            structure, shapes or dtypes differ from the saved state (naming the path and
            both shapes).
          DamagedCheckpointError: the checkpoint's files cannot be read, or the restored
            arrays differ from the checksums recorded when they were saved (naming its
            directory, the first damaged array and the older steps that can be passed
            as ``step``). Nothing is deleted.
        """
        self.wait()
        available = self.steps()
        if step is None:
            if not available:
                raise CheckpointError(
                    f"no complete checkpoint in {self.directory} to restore from "
                    "(unfinished saves, named <step>.orbax-checkpoint-tmp, do not count)"
                )
            step = available[-1]
        elif step not in available:
            raise CheckpointError(
                f"no complete checkpoint for step {step} in {self.directory}: "
                f"complete checkpoints: {_steps_text(available)}"
            )
        target = jax.tree_util.tree_map_with_path(_abstract_leaf, target)

        try:
            saved = self._manager.metadata(step).item_metadata[_STATE]
        except Exception as e:
            raise self._unreadable(step, available, e) from e
        # Orbax restores without its _METADATA file; then its own check reports mismatches.
        if saved is not None:
            self._check_matches(step, saved.tree, target, part=part)
        if part:  # Orbax's partial restore: only the target's arrays are read
            args = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                          partial_restore=True)  # fmt: skip
        else:
            args = ocp.args.StandardRestore(target)
        items = {_STATE: args, _EXTRAS: ocp.args.JsonRestore()}
        has_checksums = (self._step_dir(step) / _CHECKSUM_ITEM).exists()
        if has_checksums:
            items[_CHECKSUM_ITEM] = _ChecksumRestore()
        with _stderr_kept_on_success() if owns_process() else _stderr_untouched() as succeeded:
            try:
                restored = self._manager.restore(step, args=ocp.args.Composite(**items))
            except Exception as e:
                if self._quiet:  # its abandoned reads echo it when garbage collected, until the command exits
                    _quiet_orbax_errors.acquire()
                raise self._unreadable(step, available, e) from e
            succeeded()
        state, extras = restored[_STATE], dict(restored[_EXTRAS])
        recorded = extras.pop(_CHECKSUMS, None)  # where nnxscale kept them before the checksums item
        checksums = restored[_CHECKSUM_ITEM] if has_checksums else recorded
        if checksums is None:
            line = (f"checkpoint step {step} at {self._step_dir(step)} has no checksums (saved before nnxscale "
                    "recorded them): restored unverified")  # fmt: skip
            if warn is None:
                warnings.warn(line, stacklevel=2)
            else:
                warn(f"warning: {line}")
        self._verify(step, available, state, checksums)
        return state, extras

    def restore_intact(
        self, target, *, warn: Callable[[str], None], set_aside: bool = False, part: bool = False
    ) -> tuple[int, Any, dict]:
        """Restore the newest checkpoint that is intact: ``(step, state, extras)``.
        ``part``: ``target`` is a part of the saved state (see :meth:`restore`).

        Newer steps that are damaged (unreadable, or failing their checksums) are skipped
        with a ``warn`` line each. With ``set_aside`` (only for the writer of the
        directory) each of them is then renamed to ``<step>.damaged`` (:meth:`set_aside`),
        so that ``keep`` does not count it and a new save of that step is not refused.

        Raises:
          CheckpointError: there is no complete checkpoint; none is intact (naming every
            damaged step; nothing is renamed then, so a re-run refuses the same way); or
            the target does not fit the saved state.
        """
        damaged: list[DamagedCheckpointError] = []
        for step in reversed(self.steps()):
            try:
                state, extras = self.restore(target, step=step, warn=warn, part=part)
            except DamagedCheckpointError as e:
                damaged.append(e)
                continue
            for e in damaged:
                moved = f"; moved it to {self.set_aside(e.step)}" if set_aside else ""
                warn(
                    f"warning: checkpoint step {e.step} at {self._step_dir(e.step)} is damaged ({e.what}): "
                    f"using step {step}, the newest intact one{moved}"
                )
            return step, state, extras
        if not damaged:
            self.restore(target)  # raises "no complete checkpoint", naming the directory
        raise CheckpointError(
            f"every checkpoint in {self.directory} is damaged (steps {_steps_text(sorted(e.step for e in damaged))}; "
            f"step {damaged[0].step}: {damaged[0].what}): nothing intact to restore; start over in another "
            "--run-dir, or move the damaged steps aside to restart this one"
        )

    def set_aside(self, step: int) -> epath.Path:
        """Rename the finalized ``step`` to ``<step>.damaged`` (``.damaged.2``, ... if taken).

        Nothing is deleted: the files stay for inspection, but the step is no longer listed,
        restored, counted by ``keep``, or in the way of a new save of the same step. Every
        process calls this; process 0 renames.
        """
        source = self._step_dir(step)
        target = epath.Path(f"{source}{DAMAGED_SUFFIX}")
        for n in itertools.count(2):
            if not target.exists():
                break
            target = epath.Path(f"{source}{DAMAGED_SUFFIX}.{n}")
        if jax.process_index() == 0:
            source.rename(target)
        _sync(f"set_aside_{step}")
        self._manager.reload()
        return target

    def remove_surplus(self) -> list[int]:
        """Delete the oldest complete steps beyond ``keep``; returns the steps deleted.

        A save deletes the old steps only after it is finalized, so a crash in between
        leaves ``keep + 1``; a run that resumes already at its last step saves nothing, so
        its own saves never remove them. The writer of the directory calls this at start.
        """
        self.wait()
        surplus = self.steps()[: -self.keep]
        for step in surplus:
            self._manager.delete(step)
        return surplus

    def _verify(self, step: int, available: Sequence[int], state, recorded: Optional[dict]) -> None:
        """Compare the restored arrays with the checksums recorded at save time."""
        if recorded is None:
            return  # saved before checkpoints had checksums
        algorithm = recorded.get("algorithm")
        if algorithm not in integrity.ALGORITHMS:
            raise CheckpointError(
                f"checkpoint step {step} at {self._step_dir(step)} has checksums of kind "
                f"{algorithm!r}, which this nnxscale does not know ({', '.join(integrity.ALGORITHMS)}): "
                "restore it with the nnxscale version that saved it"
            )
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        paths = [_key_text(p) for p, _ in leaves]
        sums = recorded["arrays"]
        missing = [p for p in paths if p not in sums]
        if missing:
            raise self._damaged(step, available, f"no checksum recorded for {_shown(missing[0])}{_more(len(missing) - 1)}")
        got = integrity.checksums([leaf for _, leaf in leaves], algorithm)
        bad = [p for p, c in zip(paths, got) if sums[p] != c]
        if bad:
            raise self._damaged(
                step, available, f"the data of {_shown(bad[0])}{_more(len(bad) - 1)} does not match its checksum"
            )

    def _check_matches(self, step: int, saved_tree, target, part: bool = False) -> None:
        saved = _leaf_layouts(saved_tree)
        wanted = _leaf_layouts(target)
        where = f"checkpoint step {step} in {self._step_dir(step)}"
        hint = "is --model (and the optimizer) the same as when it was saved?"
        missing = [p for p in wanted if p not in saved]
        extra = [] if part else [p for p in saved if p not in wanted]
        if missing or extra:
            if missing:
                p = missing[0]
                diff = f"this run expects {_shown(p)} {wanted[p][0]}, which the saved state lacks"
            else:
                p = extra[0]
                diff = f"the saved state has {_shown(p)} {saved[p][0]}, which this run does not expect"
            more = len(missing) + len(extra) - 1
            raise CheckpointError(f"{where} has a different structure: {diff}{_more(more)}: {hint}")
        bad_shape = [p for p in wanted if saved[p][0] != wanted[p][0]]
        if bad_shape:
            p = bad_shape[0]
            raise CheckpointError(
                f"{where} does not fit: saved model has {_shown(p)} {saved[p][0]}, this run expects "
                f"{wanted[p][0]}{_more(len(bad_shape) - 1)}: {hint}"
            )
        bad_dtype = [p for p in wanted if saved[p][1] != wanted[p][1]]
        if bad_dtype:
            p = bad_dtype[0]
            raise CheckpointError(
                f"{where} does not fit: saved {_shown(p)} is {saved[p][1]}, this run expects "
                f"{wanted[p][1]}{_more(len(bad_dtype) - 1)}: restore with the saved dtypes and "
                "cast afterwards, or check the dtype settings"
            )

    def _save_failed(self, step: Optional[int], error: BaseException) -> CheckpointError:
        # Orbax drops the failed step (and the old steps it meant to delete) from its list;
        # re-read the directory so that the list matches the disk again.
        self._manager.reload()
        reason = os_reason(error)
        complete = self.steps()
        resume = f" (the same command resumes from step {complete[-1]})" if complete else ""
        return CheckpointError(
            f"saving checkpoint step {step} in {self.directory} failed: {reason or _cause(error)}; "
            f"complete checkpoints: {_steps_text(complete)}{resume}"
        )

    def _unreadable(self, step: int, available: Sequence[int], error: BaseException) -> CheckpointError:
        """A restore that raised: damage (data missing or that cannot be decoded, which
        :meth:`restore_intact` may skip), or anything else (permissions, I/O, memory, a bug),
        which is no reason to give up on the step: one error naming it, nothing skipped."""
        if is_damage(error):
            return self._damaged(step, available, f"it cannot be read ({_cause(error)})")
        return CheckpointError(
            f"reading checkpoint step {step} at {self._step_dir(step)} failed ({_cause(error)}); that is not damage "
            "to its files, so it was neither skipped nor renamed: fix the cause (permissions, memory, the disk) and re-run"
        )

    def _damaged(self, step: int, available: Sequence[int], what: str) -> DamagedCheckpointError:
        older = [s for s in available if s < step]
        if older:
            advice = (
                f"older checkpoints exist for steps {_steps_text(older)}: to resume from step {older[-1]}, "
                f"move {self._step_dir(step)} aside and re-run (in Python: restore(..., step={older[-1]}))"
            )
        else:
            advice = f"there is no older checkpoint in {self.directory}"
        return DamagedCheckpointError(
            f"checkpoint step {step} at {self._step_dir(step)} is damaged: {what}; nothing was deleted, and {advice}",
            step,
            what,
        )

    def _step_dir(self, step: int) -> epath.Path:
        return ocp.step.build_step_path(self.directory, self._names, step)


_barriers = itertools.count()


def _sync(name: str) -> None:
    """Wait until every process gets here (nothing to wait for in one process).

    A barrier of JAX's coordination service, not a device collective (see the module
    docstring)."""
    if jax.process_count() > 1:
        jax_private.distributed_client().wait_at_barrier(f"nnxscale_{name}_{next(_barriers)}", 600_000)


_FILTERED_LOGGERS = ("absl", "asyncio", "concurrent.futures")


#: What Orbax's threads log (absl, ERROR) when an asynchronous save fails, each also raised
#: by ``Checkpointer.wait`` and reported there in one line (Orbax 0.12.8 on a full disk).
#: Any other error Orbax logs reaches the user.
_SAVE_FAILURE_ECHOES = (
    "_SignalingThread.run() raised an exception",
    "Save Finalize thread",
    "Handler Commit operations or the Commit callback in background save thread",
)


def closed_loop_echo(error) -> bool:
    """Whether ``error`` is the echo of an abandoned Orbax write or read: its done-callback
    raising into the event loop its failed save or restore has closed."""
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


class _QuietOrbaxErrors(logging.Filter):
    """Hold back the echoes of a failed save while a save is in flight (and of a failed restore).

    When an asynchronous save fails (a full disk), Orbax's background threads each log the
    error with a traceback (absl), its abandoned writes log "Task exception was never
    retrieved" (asyncio), and their late callbacks raise "Event loop is closed" into a loop
    that is gone (reported through ``sys.unraisablehook``): hundreds of lines in all. The
    error itself is raised again by :meth:`Checkpointer.wait`, which reports it in one
    line, so these are dropped: Orbax's by their message (:data:`_SAVE_FAILURE_ECHOES`;
    any other error Orbax logs is shown), asyncio's and the loop's by what they name.
    ``NNXSCALE_DEBUG=1`` lets them through.
    """

    def __init__(self):
        super().__init__()
        self._users = 0
        self._previous_hook = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or os.environ.get("NNXSCALE_DEBUG"):
            return True
        if record.name == "concurrent.futures":  # a done-callback into the loop of an abandoned write
            return not closed_loop_echo(record.exc_info[1] if record.exc_info else None)
        if record.name == "asyncio":  # an abandoned write: its future names orbax's coroutine
            return "orbax" not in record.getMessage()
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        return not any(echo in record.getMessage() for echo in _SAVE_FAILURE_ECHOES)  # other orbax errors: shown

    def _unraisable(self, info) -> None:
        if not closed_loop_echo(info.exc_value) or os.environ.get("NNXSCALE_DEBUG"):
            self._previous_hook(info)

    def acquire(self) -> None:
        if self._users == 0:
            for name in _FILTERED_LOGGERS:
                logging.getLogger(name).addFilter(self)
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        self._users += 1

    def release(self) -> None:
        self._users -= 1
        if self._users == 0:
            for name in _FILTERED_LOGGERS:
                logging.getLogger(name).removeFilter(self)
            sys.unraisablehook = self._previous_hook


_quiet_orbax_errors = _QuietOrbaxErrors()


@contextlib.contextmanager
def _stderr_untouched():
    yield lambda: None


@contextlib.contextmanager
def _stderr_kept_on_success():
    """Hold back what is written to file descriptor 2 while a restore runs.

    When one array of a damaged checkpoint fails, orbax abandons its other reads, whose
    background threads then print tracebacks of their own. Those are consequences of the
    one error that :class:`CheckpointError` reports, so they are dropped on failure; on
    success whatever was written (warnings) is passed on.
    """
    ok = []
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield lambda: ok.append(True)
        except BaseException:
            # Let the abandoned reads finish printing: until nothing new for 0.3 s (3 s at most).
            size, deadline = -1, time.monotonic() + 3.0
            while time.monotonic() < deadline and os.fstat(held.fileno()).st_size != size:
                size = os.fstat(held.fileno()).st_size
                time.sleep(0.3)
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            if ok:
                held.seek(0)
                text = held.read()
                if text:
                    os.write(2, text)


def _abstract_leaf(path, leaf) -> jax.ShapeDtypeStruct:
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
        return leaf
    if isinstance(leaf, jax.ShapeDtypeStruct):
        what = "a jax.ShapeDtypeStruct without a sharding"
    else:
        what = type(leaf).__name__
    # Without a sharding orbax would fall back to the saved layout, which may name devices
    # or a mesh this run does not have.
    raise ValueError(
        f"restore target {_shown(_key_text(path))} is {what}: give jax.ShapeDtypeStruct(shape, dtype, "
        "sharding=NamedSharding(mesh, spec)) for this run's mesh"
    )


def _leaf_layouts(tree) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{dotted path: (shape, dtype name)}`` for a target or orbax's saved metadata tree.

    Orbax stores every pytree key as a string (list index 0 as ``"0"``, an nnx Variable's
    ``value`` attribute as a dict key), so paths are compared as dotted strings.
    """
    layouts = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            # Orbax stores a typed PRNG key array as its key data, e.g. (n,) key<fry> as (n, 2) uint32.
            leaf = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, dtype))
            dtype = leaf.dtype
        layouts[_key_text(path)] = (tuple(int(d) for d in getattr(leaf, "shape", ())), str(dtype or ""))
    return layouts


def _key_text(path) -> str:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts)


def _shown(path_text: str) -> str:
    # An nnx Variable flattens to its ``value``; the Variable's own path reads better.
    return path_text.removesuffix(".value") or "(the whole state)"


def _more(n: int) -> str:
    return f" (and {n} more)" if n > 0 else ""


def _steps_text(steps: Sequence[int]) -> str:
    return ", ".join(str(s) for s in steps) if steps else "none"


#: TensorStore's statuses for data that is missing or cannot be decoded (it reports errors
#: as ``ValueError("STATUS: ...")``): a truncated chunk is OUT_OF_RANGE, a deleted manifest
#: NOT_FOUND, a chunk that no longer decompresses FAILED_PRECONDITION ("ZSTD_decompressStream()
#: failed: Data corruption detected"; Orbax 0.12.8). PERMISSION_DENIED,
#: RESOURCE_EXHAUSTED, UNAVAILABLE and the rest are not damage.
_DAMAGE_STATUSES = ("OUT_OF_RANGE:", "NOT_FOUND:", "DATA_LOSS:", "INVALID_ARGUMENT:", "FAILED_PRECONDITION:")
#: TensorStore's words for an index of the OCDBT database that does not decode, in an error
#: without a status: flipped bytes in a b-tree node read while opening an array say
#: 'Error opening "zarr" driver: ... Error decoding b-tree node: ZSTD_decompressStream()
#: failed: Data corruption detected' (Orbax 0.12.8).
_DAMAGE_PHRASES = ("Error decoding b-tree node", "Error decoding manifest", "Data corruption detected")


def is_damage(error: BaseException) -> bool:
    """Whether a restore's ``error`` says the checkpoint's files are damaged: a file of it is
    missing, or its data cannot be decoded. An error that also says the machine is at fault
    (out of memory, an ``OSError`` such as a permission or I/O error) is not, and neither
    is anything unrecognised (a bug must not cost a checkpoint)."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    if any(isinstance(e, MemoryError) or (isinstance(e, OSError) and not isinstance(e, FileNotFoundError)) for e in chain):
        return False
    for e in chain:
        if isinstance(e, (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, ChecksumFilesDamaged)):
            return True
        if isinstance(e, ValueError) and (str(e).lstrip().startswith(_DAMAGE_STATUSES)
                                          or any(p in str(e) for p in _DAMAGE_PHRASES)):  # fmt: skip
            return True
    return False


def _cause(error: BaseException) -> str:
    # Orbax wraps TensorStore's error (which names the file and byte range) in one whose
    # text is a dump of the whole TensorStore spec: report the innermost error.
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        error = inner
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
