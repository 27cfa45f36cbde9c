"""Typed run configuration: one frozen dataclass per concern, composed in :class:`TrainConfig`.

Precedence: defaults < config file (``--config run.toml`` or ``.json``) < command-line
flags. The resolved config is written to ``RUN_DIR/config.json``; re-running on the same
run directory must not change any field that would make the resumed run a different
experiment (see :data:`RESUMABLE_FIELDS` for the ones that may change).

Every field is checked, from flags and files alike: its type when a config is read from a
dict (:meth:`TrainConfig.from_dict`: ``steps = "ten"`` or ``steps = 10.5`` are refused,
naming the field; a whole float such as ``1e3`` is taken as an integer), and its range in
:meth:`TrainConfig.validate`. Field ``optim.min_lr_ratio`` has the flag ``--min-lr-ratio``:
the last part of its name, with dashes (:func:`flag`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from pathlib import Path
from typing import Any, Optional

from nnxscale.errors import ConfigError
from nnxscale.layers.remat import remat_name

#: Most steps a run can have: the train state counts steps in an int32.
MAX_STEPS = 2**31 - 1
#: Largest seed: ``jax.random.key`` takes 32 bits (``key(2**32)`` is ``key(0)`` again).
MAX_SEED = 2**32 - 1


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
    tokenizer: Optional[str] = None  # tokenizer.json for text; None: bytes, or --init-from's own
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
    remat: str = "none"  # none, full (True), dots: see nnxscale.layers.stack.REMAT_POLICIES
    min_shard_bytes: int = 1 << 20  # parameters below this are not split over FSDP axes
    run_dir: str = "runs/quickstart"
    log_every: int = 10
    eval_every: int = 100
    save_every: int = 100
    keep: int = 3
    max_bad_steps: int = 5  # consecutive steps with a non-finite loss or gradient norm before stopping
    hang_timeout: Optional[float] = None  # seconds without progress before the job is ended; None: default; 0: off
    init_from: Optional[str] = None
    microbatches: Optional[int] = None  # pipeline microbatches; needs a `stage` mesh axis (and one needs it)
    pipeline_repeats: int = 1  # 1: GPipe; R > 1: circular, R groups of layers per stage
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()

    def __post_init__(self):
        if isinstance(self.remat, bool) or self.remat is None:  # TrainConfig(remat=True): full remat
            object.__setattr__(self, "remat", remat_name(self.remat))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Check every field's type and range (no devices, data or model needed); raise ConfigError."""
        fields = flatten(self.to_dict())
        for path, value in fields.items():
            _typed(path, value, _FIELD_TYPES[path], strict=True)
        at_least = lambda low: (lambda v: v >= low, f"at least {low}")  # noqa: E731
        below_one = (lambda v: 0 <= v < 1, "in [0, 1)")
        steps = (lambda v: 1 <= v <= MAX_STEPS, f"in [1, {MAX_STEPS}]")
        ranges = {
            "steps": steps,
            "seed": (lambda v: 0 <= v <= MAX_SEED, f"in [0, {MAX_SEED}]"),
            "dropout": below_one,
            "log_every": at_least(1),
            "eval_every": (lambda v: v >= 0, "0 (never) or positive"),
            "save_every": (lambda v: v >= 0, "0 (only at the end) or positive"),
            "keep": at_least(1),
            "max_bad_steps": at_least(1),
            "hang_timeout": (lambda v: v is None or v >= 0, "0 (off) or a positive number of seconds"),
            "optim.lr": (lambda v: v > 0, "positive"),
            "optim.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
            "optim.warmup_steps": at_least(0),
            "optim.weight_decay": at_least(0),
            "optim.beta1": below_one,
            "optim.beta2": below_one,
            "optim.grad_clip": (lambda v: v >= 0, "0 (off) or positive"),
            "optim.grad_accum": at_least(1),
            "optim.decay_steps": (lambda v: v is None or steps[0](v), steps[1]),
            "data.seq_len": at_least(1),
            "data.batch_size": at_least(1),
            "data.val_fraction": below_one,
            "data.eval_batches": at_least(1),
            "min_shard_bytes": at_least(0),
            "microbatches": (lambda v: v is None or v >= 1, "at least 1 (or unset: no pipeline)"),
            "pipeline_repeats": at_least(1),
        }
        for path, (ok, wanted) in ranges.items():
            if not ok(fields[path]):
                raise ConfigError(f"{_label(path)} must be {wanted}, got {fields[path]}")
        for path in ("model", "mesh", "rules", "run_dir", "data.data", "data.tokenizer", "init_from"):
            if fields[path] is not None and not fields[path].strip():
                raise ConfigError(f"{_label(path)} is empty")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"{_label('dtype')} must be float32 or bfloat16, got {self.dtype!r}")
        if self.remat not in ("none", "full", "dots"):
            raise ConfigError(f"{_label('remat')} must be none, full or dots, got {self.remat!r}")
        self._validate_pipeline()

    def _validate_pipeline(self) -> None:
        """What a pipeline needs that no mesh is required to check (the mesh: ``setup``)."""
        if self.pipeline_repeats > 1 and self.microbatches is None:
            raise ConfigError(
                f"--pipeline-repeats {self.pipeline_repeats} sets the circular pipeline schedule, which needs "
                "--microbatches (and a stage mesh axis, e.g. --mesh stage=2,data=4 --microbatches 8)"
            )
        if self.microbatches is not None and self.optim.grad_accum > 1:
            raise ConfigError(
                f"--grad-accum {self.optim.grad_accum} and --microbatches {self.microbatches} both split the batch: "
                "a pipeline already accumulates its microbatches' gradients, and each accumulation step would fill and "
                "drain the pipeline again (a bubble each time): use --microbatches alone "
                f"(e.g. --microbatches {self.microbatches * self.optim.grad_accum} for the same micro-batch size)"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: Optional[str] = None) -> "TrainConfig":
        """A config from a nested dict (a config file, ``config.json``), each field type-checked.

        ``source`` (e.g. ``"config file run.toml"``) starts every error message.
        """
        try:
            return _build(cls, d, "")
        except ConfigError as e:
            if source is None:
                raise
            raise ConfigError(f"{source}: {e}") from None


def flag(path: str) -> str:
    """The command-line flag of a field: ``"optim.min_lr_ratio"`` -> ``"--min-lr-ratio"``."""
    return "--" + path.rsplit(".", 1)[-1].replace("_", "-")


def _label(path: str) -> str:
    """How errors name a field: ``--steps``, ``--min-lr-ratio (optim.min_lr_ratio)``."""
    return flag(path) if "." not in path else f"{flag(path)} ({path})"


def _build(cls, d, prefix: str):
    """``cls`` (a config dataclass) from a dict, recursively, each field type-checked."""
    if isinstance(d, cls):
        return d
    where = f"[{prefix[:-1]}]" if prefix else "the config"
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a table of fields, got {d!r}")
    hints = typing.get_type_hints(cls)
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(f"unknown fields {unknown} in {where}; valid fields are {known}")
    values = {}
    for name, value in d.items():
        hint = hints[name]
        if prefix + name == "remat" and isinstance(value, bool):  # remat = true: full rematerialization
            value = remat_name(value)
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            values[name] = _typed(prefix + name, value, hint, strict=False)
    return cls(**values)


def _typed(path: str, value, hint, *, strict: bool):
    """``value`` as the field's type (``int``, ``float``, ``str``, ``bool``, ``Optional[...]``).

    Not ``strict`` (values read from a file): a whole float (``1e3``) becomes an ``int``
    and an ``int`` in a float field a ``float``. Floats must be finite. Raises ConfigError
    naming the field and what it got.
    """
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        if value is None:
            return None
        (hint,) = (a for a in args if a is not type(None))
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if not strict and isinstance(value, float) and value.is_integer():
            return int(value)
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{_label(path)} must be a finite number, got {value}")
        return value if strict else float(value)
    if hint is str and isinstance(value, str):
        return value
    wanted = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}[hint]
    raise ConfigError(
        f"{_label(path)} must be {wanted}{' or unset' if optional else ''}, got {value!r} ({type(value).__name__})"
    )


#: Fields that may differ between a run directory's config and a resuming command:
#: how long to run, where (mesh, rules), and how often to log/save. Anything else would
#: silently turn the resumed run into a different experiment. The pipeline settings go
#: with the mesh (a ``stage`` axis needs them) and give the same numbers without dropout.
#: ``optim.decay_steps`` (the LR schedule's length) is fixed by a run's first command; a command that leaves it unset
#: takes the run's own, so growing ``--steps`` does not restart warmup.
RESUMABLE_FIELDS = frozenset(
    {"steps", "mesh", "rules", "run_dir", "log_every", "eval_every", "save_every", "keep", "remat", "init_from",
     "min_shard_bytes", "max_bad_steps", "hang_timeout", "data.eval_batches", "microbatches", "pipeline_repeats"}
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


def _field_types(cls, prefix: str = "") -> dict[str, Any]:
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            out.update(_field_types(hint, f"{prefix}{name}."))
        else:
            out[prefix + name] = hint
    return out


#: Dotted field name -> its type, for every field of :class:`TrainConfig`.
_FIELD_TYPES = _field_types(TrainConfig)
