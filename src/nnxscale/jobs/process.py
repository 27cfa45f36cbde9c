"""Who owns the process: the ``nnxscale`` command, or the Python program that called nnxscale.

The command line owns its process (:func:`owned_by_command`, entered by
``nnxscale.cli.main``), and so may act on all of it: a second Ctrl-C or SIGTERM ends it at
once (``os._exit``, as after ``kill -9`` the next run resumes from the last complete
checkpoint); the hang watchdog ends it when no progress is made; the echoes that Orbax's
background threads print after an error the command already reported in one line are held
back (log filters, ``sys.unraisablehook``, file descriptor 2 during restores).

Called from Python (a script, a notebook), nnxscale changes nothing process-wide beyond the
call that needs it: ``train`` still turns a first Ctrl-C into a clean stop with a
checkpoint, and a second one raises ``KeyboardInterrupt`` in the caller; the hang watchdog
runs only when asked for (``TrainConfig.hang_timeout`` or ``NNXSCALE_HANG_TIMEOUT``) or in a
job of several processes, where a hung process would otherwise hang its peers; Orbax's logs
and standard error are left as they are.
"""

from __future__ import annotations

import contextlib

_owned = False


def owns_process() -> bool:
    """Whether the ``nnxscale`` command (or a caller that asked, :func:`owned_by_command`) owns the process."""
    return _owned


@contextlib.contextmanager
def owned_by_command():
    """Within the block nnxscale acts as the owner of the process (what the CLI does)."""
    global _owned
    before, _owned = _owned, True
    try:
        yield
    finally:
        _owned = before
