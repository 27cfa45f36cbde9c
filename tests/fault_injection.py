"""Real faults for tests: damaged checkpoint files, a small file system that fills up."""

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile


def flip_bytes(step_dir, count: int = 256, *, every: bool = False) -> str:
    """Invert ``count`` bytes in the middle of a checkpoint step's largest data file (with
    ``every``: of each of its data files, so the parameters are hit too, not only the
    optimizer state, whatever file Orbax put them in).

    The file keeps its size, so Orbax reads it without any error: only checksums notice.
    Returns the (largest) file's path.
    """
    files = [os.path.join(root, f) for root, _, names in os.walk(os.path.join(step_dir, "state")) for f in names]
    path = max(files, key=os.path.getsize)
    data_files = [f for f in files if os.sep + "d" + os.sep in f and os.path.getsize(f) > 4 * count] if every else [path]
    for name in data_files:
        size = os.path.getsize(name)
        assert size > 4 * count, f"{name} has {size} bytes: too small to damage in the middle"
        with open(name, "r+b") as f:
            f.seek(size // 2)
            data = f.read(count)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in data))
    return path


@functools.cache
def can_mount() -> bool:
    """Whether a small tmpfs can be mounted here: tried once, for real (root is not enough
    in a container without CAP_SYS_ADMIN, and a user namespace may allow it without root)."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return False
    probe = tempfile.mkdtemp(prefix="nnxscale-mount-probe-")
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe], capture_output=True)
        if mounted.returncode != 0:
            return False
        return subprocess.run(["umount", probe], capture_output=True).returncode == 0
    finally:
        os.rmdir(probe)


@contextlib.contextmanager
def small_filesystem(path, size: str):
    """A tmpfs of ``size`` (e.g. ``"5m"``) mounted at ``path``: writes beyond it fail with ENOSPC.

    Needs root (CI runs as root). Yields a function that resizes it (``grow("64m")``), which
    frees space the way deleting files would.
    """
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield lambda new: subprocess.run(["mount", "-o", f"remount,size={new}", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
