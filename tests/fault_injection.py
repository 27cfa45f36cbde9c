"""Real faults for tests: damaged checkpoint files, a small file system that fills up."""

import contextlib
import os
import subprocess


def flip_bytes(step_dir, count: int = 256) -> str:
    """Invert ``count`` bytes in the middle of a checkpoint step's largest data file.

    The file keeps its size, so Orbax reads it without any error: only checksums notice.
    Returns the file's path.
    """
    files = [os.path.join(root, f) for root, _, names in os.walk(os.path.join(step_dir, "state")) for f in names]
    path = max(files, key=os.path.getsize)
    size = os.path.getsize(path)
    assert size > 4 * count, f"{path} has {size} bytes: too small to damage in the middle"
    with open(path, "r+b") as f:
        f.seek(size // 2)
        data = f.read(count)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
    return path


def can_mount() -> bool:
    return os.geteuid() == 0


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
