"""A run directory's files: ``config.json``, ``metrics.jsonl`` (appended, repaired after a crash), ``loss.png``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
from pathlib import Path
from typing import Optional

from nnxscale.data import text as text
from nnxscale.errors import RunFileError, storage_error
from nnxscale.training.config import ConfigError, TrainConfig, config_conflicts


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file, then a rename."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise storage_error("writing", path, e) from None


def saved_config(run_dir) -> Optional[dict]:
    """The ``train`` config a run directory's ``config.json`` holds (a dict), or ``None``.

    Raises RunFileError naming the file if it cannot be read or is not a config.
    """
    path = Path(run_dir) / "config.json"
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except OSError as e:
        raise storage_error("reading", path, e) from None
    except ValueError:  # not JSON, or not text at all
        raise RunFileError(f"{path} is not valid JSON; fix or remove it") from None
    saved = saved.get("train", saved) if isinstance(saved, dict) else saved
    try:
        TrainConfig.from_dict(saved, source=str(path))
    except ConfigError as e:
        raise RunFileError(f"{e}; fix or remove it") from None
    return saved


def with_saved_schedule_length(cfg: TrainConfig, run_dir: Path) -> TrainConfig:
    """The LR schedule's length is set by a run's first command and kept on resume.

    So ``--steps`` can grow when resuming without restarting warmup or stretching the decay:
    past the schedule's end the learning rate stays at its final value.
    """
    if cfg.optim.decay_steps is not None:
        return cfg
    saved = saved_config(run_dir)
    length = (saved or {}).get("optim", {}).get("decay_steps") or cfg.steps
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, decay_steps=length))


def check_run_dir(cfg: TrainConfig, run_dir: Path) -> None:
    """Refuse a run directory whose saved config makes this a different experiment."""
    saved = saved_config(run_dir)
    if saved is None:
        return
    conflicts = config_conflicts(saved, cfg.to_dict())
    if conflicts:
        raise ConfigError(
            f"run directory {run_dir} holds a different run ("
            + "; ".join(conflicts)
            + "): use another --run-dir, or repeat the original settings to resume"
        )


def plot_metrics(run_dir: Path) -> Optional[Path]:
    """Draw ``loss.png`` (train and validation loss against step) from ``metrics.jsonl``."""
    rows = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]  # null: a skipped step
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if not train:
        return None
    # A Figure of its own, drawn by the Agg canvas: pyplot's import (half a second of CPU in
    # every process that trains) and its global backend and figure registry are not needed.
    from matplotlib.figure import Figure  # slow to import: to draw only

    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.subplots()
    ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"nnxscale: {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = run_dir / "loss.png"
    try:
        fig.savefig(out)
    except OSError as e:
        raise storage_error("writing", out, e) from None
    return out


def _json_line(record: dict) -> str:
    """One strict JSON line: NaN and Inf become ``null`` (bare ``NaN`` is not JSON)."""
    clean = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in record.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def append_metrics(path: Path, record: dict) -> None:
    """Append one record to ``metrics.jsonl``.

    A write that fails part-way (a full disk) is cut back off, so the file holds whole
    lines only; a crash in the middle of the write leaves at most a partial last line,
    which :func:`repair_metrics` removes when the run resumes.
    """
    data = memoryview(_json_line(record).encode())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise storage_error("writing", path, e) from None
    try:
        size = os.fstat(fd).st_size
        try:
            while data:  # a short write is followed by one that reports why (ENOSPC, EFBIG, ...)
                written = os.write(fd, data)
                if not written:
                    raise OSError(errno.EIO, "nothing written")
                data = data[written:]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise storage_error("writing", path, e) from None
    finally:
        os.close(fd)


def _metrics_lines(path: Path) -> list[tuple[str, Optional[dict]]]:
    """``(line, record)`` per line of ``metrics.jsonl``; a partial last line has record ``None``.

    Raises RunFileError naming the file and line for any other line that is not a record.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise storage_error("reading", path, e) from None
    lines = text.splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with a step")
        except ValueError as e:
            if number == len(lines) and not text.endswith("\n"):
                out.append((line, None))  # cut off by a crash while it was written
                break
            raise RunFileError(f"{path} line {number} is not a metrics record ({e}); fix or remove that line") from None
        out.append((line, record))
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``metrics.jsonl``, oldest first (a partial last line is left out)."""
    return [r for _, r in _metrics_lines(Path(run_dir) / "metrics.jsonl") if r is not None]


def repair_metrics(path: Path, last_step: int) -> None:
    """Drop records past the checkpoint being resumed from (they are logged again), and a
    partial last line left by a crash. Rewrites the file atomically, and only if needed."""
    lines = _metrics_lines(path)
    keep = [line for line, r in lines if r is not None and r["step"] <= last_step]
    if len(keep) < len(lines):
        write_atomic(path, "".join(line + "\n" for line in keep))
