"""One trainer per run directory: a lock held for as long as the trainer lives.

Two trainers on one ``--run-dir`` would delete each other's saves in progress and
interleave ``metrics.jsonl``. So a trainer takes ``RUN_DIR/lock`` before it writes
anything and keeps it until it ends; a second one is refused at once, with one line
naming the holder (host, process id, since when), which the holder writes into the file.

The lock is ``flock(2)`` on that file, so the operating system releases it whenever the
holder's process ends, however it ends: after ``kill -9`` the next trainer proceeds, with
no stale-lock timeout to wait for and no lock file to delete by hand. On NFS, Linux
implements ``flock`` with NFS byte-range locks, which every client sees; if the holder's
whole machine dies, its NFS server frees the lock when the client's lease expires (about
90 s). On a file system that supports no locking at all, the trainer warns and runs
unlocked. With many processes, process 0 holds the lock for all of them and tells the
others whether it got it.

The file stays in the run directory; it is emptied when its holder ends cleanly.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable, Optional

import jax
from jax.experimental import multihost_utils

from nnxscale.errors import RunLockedError, storage_error

LOCK_NAME = "lock"

# Lock files held by this process (resolved paths): flock conflicts between two open
# files even in one process, but on NFS it becomes a POSIX lock, which does not.
_held: set[str] = set()


class RunLock:
    """``RUN_DIR/lock`` held by this trainer; a context manager (acquire on enter).

    Args:
      run_dir: the run directory; must exist.
      warn: called with one line when the file system cannot lock at all.

    With several processes every one calls :meth:`acquire`: process 0 takes the lock,
    and all of them raise if it was refused.
    """

    def __init__(self, run_dir, *, warn: Callable[[str], None] = print):
        self.path = Path(run_dir) / LOCK_NAME
        self._warn = warn
        self._fd: Optional[int] = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock or raise :class:`RunLockedError` naming the holder."""
        refused = None
        if jax.process_index() == 0:
            try:
                self._lock()
            except RunLockedError as e:
                refused = e
        if jax.process_count() > 1:
            got = bool(multihost_utils.broadcast_one_to_all(refused is None))
            if not got and refused is None:
                refused = RunLockedError(f"run directory {self.path.parent} is in use by another trainer (see process 0)")
        if refused is not None:
            raise refused

    def release(self) -> None:
        """Empty the file and release the lock (a no-op if not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # nobody holds it: a later reader finds no holder
        except OSError:
            pass  # a full or read-only disk: the details stay, the lock is released anyway
        finally:
            _held.discard(str(self.path.resolve()))
            os.close(fd)  # releases the flock

    def _lock(self) -> None:
        key = str(self.path.resolve())
        if key in _held:
            raise RunLockedError(
                f"run directory {self.path.parent} is in use by another trainer in this process (pid {os.getpid()}): "
                "wait for it to finish, or use another --run-dir"
            )
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise storage_error("creating the lock file", self.path, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLockedError(
                f"run directory {self.path.parent} is in use by another trainer ({holder}): "
                "wait for it to finish or stop it, or use another --run-dir"
            ) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise storage_error("locking", self.path, e) from None
            self._warn(
                f"warning: the file system of {self.path} cannot lock files ({os.strerror(e.errno)}): "
                "a second trainer on this run directory would not be detected"
            )
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        except OSError as e:
            os.close(fd)
            raise storage_error("writing", self.path, e) from None
        self._fd = fd
        _held.add(key)


def _read_holder(fd: int) -> str:
    """``host H, process P, since T (N s ago)`` from the holder's lock file, as far as known."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "null")
        since = float(info["since"])
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(since))
        return f"host {info['host']}, process {info['pid']}, since {when} ({time.time() - since:.0f} s ago)"
    except (OSError, ValueError, TypeError, KeyError):
        return "which has not written its host and process id yet"
