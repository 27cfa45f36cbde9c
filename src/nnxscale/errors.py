"""Every error nnxscale raises for input it cannot use derives from :class:`NnxscaleError`.

The message says what was wrong (the offending name and numbers) and what to do. The CLI
prints such an error as one line and exits with code 2; any other exception is a bug in
nnxscale or below it, and the CLI lets its traceback show.

Each class also derives from the built-in exception a Python caller would expect
(``ValueError`` for bad values, ``FileNotFoundError`` for a missing file), so
``except ValueError`` keeps working.
"""

from __future__ import annotations

import errno
import os
import re
from typing import Optional


class NnxscaleError(Exception):
    """Base class of nnxscale's user-facing errors."""


class MeshError(NnxscaleError, ValueError):
    """A mesh spec that cannot be built on the devices that exist."""


class LayoutError(NnxscaleError, ValueError):
    """A PartitionSpec that cannot lay out a tensor on a mesh."""


class RulesError(NnxscaleError, ValueError):
    """A rules preset or rules spec that cannot be used."""


class ConfigError(NnxscaleError, ValueError):
    """A configuration that cannot be run, or that conflicts with the run directory."""


class ModelError(NnxscaleError, ValueError):
    """A model config, preset or weights file that does not describe a usable model."""


class ModelFileNotFoundError(ModelError, FileNotFoundError):
    """A model directory or one of its files does not exist."""


class DataError(NnxscaleError, ValueError):
    """A data source, split or batch layout that cannot be used."""


class CheckpointError(NnxscaleError, RuntimeError):
    """A checkpoint that cannot be saved or restored as asked; the message says what to do."""



class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files cannot be read or whose data fails its checksums.

    ``step`` is the damaged step, ``what`` what is wrong with it (part of the message).
    """

    def __init__(self, message: str, step: int, what: str):
        super().__init__(message)
        self.step = step
        self.what = what

class JobError(NnxscaleError, ValueError):
    """A multi-process job that cannot be joined or launched as asked (flags, ports, processes)."""


class StorageError(NnxscaleError, OSError):
    """A run file or checkpoint that cannot be written or read: the disk is full, read only, ..."""


class RunFileError(NnxscaleError, ValueError):
    """A file of a run directory (``config.json``, ``metrics.jsonl``) that is not what it should be."""


class RunLockedError(NnxscaleError, RuntimeError):
    """Another trainer holds the run directory."""


class DivergenceError(NnxscaleError, FloatingPointError):
    """Training stopped: the loss or gradient norm stayed non-finite for too many steps."""


class DonatedStateError(NnxscaleError, RuntimeError):
    """A train state passed to a step that already took it: the step donates its state, so
    its arrays are gone; the state to pass on is the one the step returned."""


class JaxVersionError(NnxscaleError, RuntimeError):
    """The installed jax lacks a name nnxscale relies on (one of JAX's private ones)."""


class CompileError(NnxscaleError, RuntimeError):
    """A target's compiler (run by ``plan --target`` in a child process) failed on the step:
    the message holds the child's error line."""


#: errno -> what a user would call it (others: the system's own text, ``os.strerror``).
_OS_REASONS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EFBIG: "file too large for the file system or the process's file-size limit",
}


def os_reason(error: BaseException) -> Optional[str]:
    """What went wrong in a failed file operation, in words (``"disk full"``), or ``None``.

    Reads ``errno`` from an ``OSError``, or the ``os_error_code`` that TensorStore (Orbax's
    storage layer) puts in its messages, from ``error`` or the errors it wraps.
    """
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        code = getattr(error, "errno", None)
        if code is None:
            found = re.search(r"os_error_code='?(\d+)", str(error))
            code = int(found.group(1)) if found else None
        if code is not None:
            return _OS_REASONS.get(code) or os.strerror(code).lower()
        error = error.__cause__ or error.__context__
    return None


def storage_error(action: str, path, error: BaseException, advice: str = "") -> StorageError:
    """One line for a failed file operation: ``writing /run/metrics.jsonl failed: disk full``."""
    reason = os_reason(error) or f"{type(error).__name__}: {error}"
    return StorageError(f"{action} {path} failed: {reason}" + (f"; {advice}" if advice else ""))
