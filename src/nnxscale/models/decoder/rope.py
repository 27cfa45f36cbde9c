"""Rotary position embeddings: the frequency scalings Hugging Face's checkpoints name
(``rope_type`` default, linear, llama3, yarn), each a frozen dataclass a config records, and
the rotation itself in either pair layout.

Frequencies are computed in float64 on the host, as numbers of the config, so every mesh and
every program computes the same tables.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import jax.numpy as jnp
import numpy as np

from nnxscale.errors import ModelError


def _positive(where: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelError(f"{where}.{name} must be a positive number, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling (HF ``rope_scaling`` with ``rope_type: llama3``).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are
    kept, those longer than ``original_max_position_embeddings / low_freq_factor`` are
    stretched ``factor`` times, and those between are interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _positive("rope_scaling", name, getattr(self, name))
        if not self.low_freq_factor < self.high_freq_factor:
            raise ModelError(
                f"rope_scaling.low_freq_factor={self.low_freq_factor} must be below "
                f"high_freq_factor={self.high_freq_factor} (Llama 3.1: 1 and 4)"
            )
        n = self.original_max_position_embeddings
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ModelError(f"rope_scaling.original_max_position_embeddings must be a positive integer, got {n!r}")

    def frequencies(self, inv_freq: np.ndarray, theta: float) -> tuple[np.ndarray, float]:
        old = self.original_max_position_embeddings
        wavelen = 2 * np.pi / inv_freq
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        mixed = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = np.where(wavelen < old / self.high_freq_factor, inv_freq,
                          np.where(wavelen > old / self.low_freq_factor, inv_freq / self.factor, mixed))  # fmt: skip
        return scaled, 1.0


@dataclasses.dataclass(frozen=True)
class LinearScaling:
    """Position interpolation (HF ``rope_type: linear``): every frequency divided by ``factor``
    (Gemma 3's global layers: 8)."""

    factor: float
    rope_type: str = "linear"

    def __post_init__(self):
        _positive("rope_scaling", "factor", self.factor)

    def frequencies(self, inv_freq: np.ndarray, theta: float) -> tuple[np.ndarray, float]:
        return inv_freq / self.factor, 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al., 2023; HF ``rope_type: yarn``, Qwen3's long context and DeepSeek-V3):
    frequencies below the ``beta_slow`` rotations over ``original_max_position_embeddings``
    are interpolated ``factor`` times, those above ``beta_fast`` kept, a linear ramp between;
    the rotary tables are multiplied by ``attention_factor`` (by default from ``mscale`` and
    ``mscale_all_dim``, as transformers computes it)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True
    rope_type: str = "yarn"

    def __post_init__(self):
        _positive("rope_scaling", "factor", self.factor)
        n = self.original_max_position_embeddings
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ModelError(f"rope_scaling.original_max_position_embeddings must be a positive integer, got {n!r}")

    @property
    def table_factor(self) -> float:
        """What the rotary tables are multiplied by."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def frequencies(self, inv_freq: np.ndarray, theta: float) -> tuple[np.ndarray, float]:
        dim = 2 * len(inv_freq)
        base = theta

        def correction(rotations):  # the dimension that turns ``rotations`` times over the original context
            return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction(self.beta_fast), correction(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1: extrapolate (the frequency as it is), 0: interpolate
        return inv_freq / self.factor * (1 - keep) + inv_freq * keep, self.table_factor


Scaling = Union[RopeScaling, LinearScaling, YarnScaling]
SCALINGS = {"llama3": RopeScaling, "linear": LinearScaling, "yarn": YarnScaling}


def parse_rope_scaling(d: Optional[dict], where: str) -> Optional[Scaling]:
    """A ``rope_scaling`` mapping as its dataclass (``None`` for ``rope_type`` default or no
    mapping); ``where`` names its source in errors. Keys other than the type's fields and
    the ones every HF mapping may carry are an error, as is a missing field."""
    if d is None or isinstance(d, (RopeScaling, LinearScaling, YarnScaling)):
        return d
    if not isinstance(d, dict):
        raise ModelError(f"{where} must be a mapping of the scaling's fields, got {d!r}")
    kind = d.get("rope_type", d.get("type", "llama3" if "low_freq_factor" in d else None))
    if kind in (None, "default"):
        return None
    if kind not in SCALINGS:
        raise ModelError(f"{where}: rope_type={kind!r} is not supported (supported: default, {', '.join(SCALINGS)})")
    cls = SCALINGS[kind]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
    carried = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    extra = sorted(set(d) - set(fields) - carried)
    missing = [k for k in required if d.get(k) is None]
    if extra or missing:
        raise ModelError(f"{where} needs exactly the fields {list(fields if kind != 'llama3' else required)}; "
                         f"missing {missing}, unknown {extra}")  # fmt: skip
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelError(f"{where}: partial_rotary_factor={d['partial_rotary_factor']!r} is not supported (1.0 only)")
    return cls(**{k: d[k] for k in fields if k in d and k != "rope_type"})


def hf_scaling(scaling: Optional[Scaling]) -> Optional[dict]:
    """``scaling`` as HF's ``rope_scaling`` mapping (with ``rope_type``)."""
    if scaling is None:
        return None
    d = dataclasses.asdict(scaling)
    d.pop("rope_type", None)
    kind = next(k for k, cls in SCALINGS.items() if isinstance(scaling, cls))
    return {"rope_type": kind, **{k: v for k, v in d.items() if v is not None}}


def rope_frequencies(head_dim: int, theta: float, scaling: Optional[Scaling]) -> np.ndarray:
    """Rotary inverse frequencies ``(head_dim // 2,)`` with ``scaling`` applied, in float64."""
    return rope_tables_spec(head_dim, theta, scaling)[0]


def rope_tables_spec(head_dim: int, theta: float, scaling: Optional[Scaling]) -> tuple[np.ndarray, float]:
    """``(inverse frequencies (head_dim // 2,), the factor the cos/sin tables are multiplied by)``."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if scaling is None:
        return inv_freq, 1.0
    return scaling.frequencies(inv_freq, theta)


def rope_tables(positions, head_dim: int, theta: float, scaling: Optional[Scaling]):
    """``(cos, sin)`` ``([B,] T, head_dim)`` float32 for ``positions`` ``([B,] T)``, in HF's
    ``rotate_half`` layout (frequency ``i`` at ``i`` and ``i + head_dim/2``)."""
    inv_freq, factor = rope_tables_spec(head_dim, theta, scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq.astype(np.float32)  # ([B,] T, H/2)
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if factor != 1.0:
        cos, sin = cos * np.float32(factor), sin * np.float32(factor)
    return cos, sin


def rotate(x, cos, sin, *, interleaved: bool = False):
    """Rotary embedding of ``x (B, T, N, H)`` in HF's layout: dimension ``i`` pairs with
    ``i + H/2`` (``rotate_half``). ``interleaved`` (DeepSeek's ``rope_interleave``): the
    pairs are adjacent dimensions ``(2i, 2i+1)``, gathered into the half layout first, as
    transformers' ``apply_rotary_pos_emb_interleave`` does (so the output is in half layout)."""
    if interleaved:
        B, T, N, H = x.shape
        x = x.reshape(B, T, N, H // 2, 2).swapaxes(-1, -2).reshape(B, T, N, H)
    x1, x2 = jnp.split(x, 2, axis=-1)  # each (B, T, N, H/2)
    rotated = jnp.concatenate([-x2, x1], axis=-1)  # (B, T, N, H)
    cos, sin = cos[..., None, :].astype(x.dtype), sin[..., None, :].astype(x.dtype)  # ([B,] T, 1, H)
    return x * cos + rotated * sin
