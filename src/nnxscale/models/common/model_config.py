"""What every model family's config shares: the training fields' checks, a dict round
trip, and presets with overrides. Each family's config is a frozen dataclass deriving
from :class:`ModelConfig`, with fields ``dropout``, ``dtype``, ``param_dtype``, ``remat``,
``attention``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from nnxscale.errors import ModelError
from nnxscale.layers.attention_names import IMPLEMENTATIONS
from nnxscale.layers.remat import remat_name
from nnxscale.layers.stack import REMAT_POLICIES

DTYPES = ("float32", "bfloat16")


class ModelConfig:
    def _check_training_fields(self) -> None:
        """Normalize ``remat`` (``True`` -> ``"full"``) and check it, ``attention``, ``dropout``
        and the dtypes."""
        name = type(self).__name__
        if isinstance(self.remat, bool) or self.remat is None:
            object.__setattr__(self, "remat", remat_name(self.remat))
        if self.remat not in REMAT_POLICIES:
            raise ModelError(f"{name}.remat must be one of {', '.join(REMAT_POLICIES)} (or a bool), got {self.remat!r}")
        if self.attention not in IMPLEMENTATIONS:
            raise ModelError(f"{name}.attention must be one of {', '.join(IMPLEMENTATIONS)}, got {self.attention!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ModelError(f"{name}.dropout must be in [0, 1), got {self.dropout!r}")
        for field in ("dtype", "param_dtype"):
            if getattr(self, field) not in DTYPES:
                raise ModelError(f"{name}.{field} must be one of {DTYPES}, got {getattr(self, field)!r}")

    def _check_positive_ints(self, fields: Iterable[str]) -> None:
        for field in fields:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelError(f"{type(self).__name__}.{field} must be a positive integer, got {value!r}")

    @classmethod
    def check_field_names(cls, names: Iterable[str]) -> None:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(names) - fields)
        if unknown:
            raise ModelError(f"unknown {cls.__name__} fields {unknown}; valid fields: {sorted(fields)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        cls.check_field_names(d)
        return cls(**d)


def choose_preset(presets: Mapping[str, ModelConfig], family: str, name: str, overrides: Mapping[str, Any]):
    """``presets[name]`` with fields replaced by ``overrides`` (validated again)."""
    if name not in presets:
        raise ModelError(f"unknown {family} preset {name!r}: choose one of {', '.join(presets)}")
    config = presets[name]
    type(config).check_field_names(overrides)
    return dataclasses.replace(config, **overrides)
