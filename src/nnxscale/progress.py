"""Progress bars of the long commands (train, tokenize): rich, or nothing when disabled."""

from __future__ import annotations

from typing import Optional


class ProgressBar:
    """``label``, the bar, the count (``n/total``, or bytes and speed with ``in_bytes``), a
    line of text the caller updates, and the time remaining. Does nothing when disabled."""

    def __init__(self, enabled: bool, label: str, total: int, *, completed: int = 0, in_bytes: bool = False):
        self._bar = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )  # fmt: skip

        counts = (DownloadColumn(), TransferSpeedColumn()) if in_bytes else (MofNCompleteColumn(),)
        self._bar = Progress(
            TextColumn(f"[bold]{label}"), BarColumn(), *counts, TextColumn("{task.fields[info]}"), TimeRemainingColumn()
        )
        self._task = self._bar.add_task(label, total=total, completed=completed, info="")
        self._bar.start()

    def update(self, completed: int, info: Optional[str] = None) -> None:
        """Move to ``completed``; ``info`` replaces the line of text (``None`` keeps it)."""
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, **({} if info is None else {"info": info}))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
