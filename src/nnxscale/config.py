"""Typed run configuration: one frozen dataclass per concern, composed in :class:`TrainConfig`.

Precedence: defaults < config file (``--config run.toml`` or ``.json``) < command-line
flags. The resolved config is written to ``RUN_DIR/config.json``; re-running on the same
run directory must not change any field that would make the resumed run a different
experiment (see :data:`RESUMABLE_FIELDS` for the ones that may change).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any, Optional

from nnxscale.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``lr * min_lr_ratio``."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1  # on kernels and embeddings only, never biases or norms
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    grad_accum: int = 1  # micro-batches per step; the batch size is per step
    decay_steps: Optional[int] = None  # schedule length; None: --steps of the run's first command


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are batched (sizes are global, all processes)."""

    data: Optional[str] = None  # None: the Python standard library's own source files
    seq_len: int = 128
    batch_size: int = 32
    val_fraction: float = 0.005
    eval_batches: int = 4


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs. ``nnxscale train --help`` documents each field."""

    model: str = "gpt2-mini"
    mesh: str = "data=4,model=2"
    rules: str = "auto"
    steps: int = 300
    seed: int = 0
    dropout: float = 0.0
    dtype: str = "float32"  # compute dtype; parameters stay float32
    remat: str = "none"  # none, full (True), dots: see nnxscale.stack.REMAT_POLICIES
    min_shard_bytes: int = 1 << 20  # parameters below this are not split over FSDP axes
    run_dir: str = "runs/quickstart"
    log_every: int = 10
    eval_every: int = 100
    save_every: int = 100
    keep: int = 3
    init_from: Optional[str] = None
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()

    def __post_init__(self):
        if isinstance(self.remat, bool) or self.remat is None:  # TrainConfig(remat=True): full remat
            object.__setattr__(self, "remat", "full" if self.remat else "none")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Check the fields that need no devices, data or model; raise ConfigError."""
        checks = [
            (self.steps >= 1, f"--steps must be at least 1, got {self.steps}"),
            (self.log_every >= 1, f"--log-every must be at least 1, got {self.log_every}"),
            (self.eval_every >= 0, f"--eval-every must be 0 (never) or positive, got {self.eval_every}"),
            (self.save_every >= 0, f"--save-every must be 0 (only at the end) or positive, got {self.save_every}"),
            (self.keep >= 1, f"--keep must be at least 1, got {self.keep}"),
            (self.optim.grad_accum >= 1, f"--grad-accum must be at least 1, got {self.optim.grad_accum}"),
            (self.data.batch_size >= 1, f"--batch-size must be at least 1, got {self.data.batch_size}"),
            (self.data.seq_len >= 1, f"--seq-len must be at least 1, got {self.data.seq_len}"),
            (0 <= self.data.val_fraction < 1, f"--val-fraction must be in [0, 1), got {self.data.val_fraction}"),
            (0 <= self.dropout < 1, f"--dropout must be in [0, 1), got {self.dropout}"),
            (self.optim.lr > 0, f"--lr must be positive, got {self.optim.lr}"),
            (self.dtype in ("float32", "bfloat16"), f"--dtype must be float32 or bfloat16, got {self.dtype!r}"),
            (self.remat in ("none", "full", "dots"), f"--remat must be none, full or dots, got {self.remat!r}"),
            (self.min_shard_bytes >= 0, f"--min-shard-bytes must be 0 or positive, got {self.min_shard_bytes}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config fields {sorted(unknown)}; valid fields are {sorted(known)}")
        optim = _sub(OptimConfig, d.pop("optim", {}), "optim")
        data = _sub(DataConfig, d.pop("data", {}), "data")
        return cls(**d, optim=optim, data=data)


def _sub(cls, d, name):
    if isinstance(d, cls):
        return d
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ConfigError(f"unknown fields {sorted(unknown)} in [{name}]; valid fields are {sorted(known)}")
    return cls(**d)


#: Fields that may differ between a run directory's config and a resuming command:
#: how long to run, where (mesh, rules), and how often to log/save. Anything else would
#: silently turn the resumed run into a different experiment. ``optim.decay_steps`` (the
#: LR schedule's length) is fixed by a run's first command; a command that leaves it unset
#: takes the run's own, so growing ``--steps`` does not restart warmup.
RESUMABLE_FIELDS = frozenset(
    {"steps", "mesh", "rules", "run_dir", "log_every", "eval_every", "save_every", "keep", "remat", "init_from",
     "min_shard_bytes", "data.eval_batches"}
)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def with_overrides(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """Apply dotted overrides ``{"optim.lr": 1e-3, "steps": 10}``."""
    d = cfg.to_dict()
    for key, value in overrides.items():
        node = d
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        if leaf not in node:
            raise ConfigError(f"unknown config field {key!r}")
        node[leaf] = value
    return TrainConfig.from_dict(d)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON config file into a nested dict."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        if p.suffix == ".toml":
            return tomllib.loads(p.read_text())
        return json.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from None


def config_conflicts(saved: dict, new: dict) -> list[str]:
    """Fields outside :data:`RESUMABLE_FIELDS` whose values differ, as readable lines."""
    a, b = flatten(saved), flatten(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if key in RESUMABLE_FIELDS:
            continue
        if a.get(key) != b.get(key):
            out.append(f"{key}: run directory has {a.get(key)!r}, this command has {b.get(key)!r}")
    return out
