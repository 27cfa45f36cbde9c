"""The llama config and its presets.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from flax import nnx

from nnxscale.errors import ModelError
from nnxscale.models.common.model_config import ModelConfig, choose_preset

_normal = nnx.initializers.normal(0.02)  # HF's initializer_range for every weight matrix
_ones = nnx.initializers.ones_init()


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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ModelError(f"rope_scaling.{name} must be a positive number, got {value!r}")
        if not self.low_freq_factor < self.high_freq_factor:
            raise ModelError(
                f"rope_scaling.low_freq_factor={self.low_freq_factor} must be below "
                f"high_freq_factor={self.high_freq_factor} (Llama 3.1: 1 and 4)"
            )
        n = self.original_max_position_embeddings
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ModelError(f"rope_scaling.original_max_position_embeddings must be a positive integer, got {n!r}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """Llama hyperparameters, named as in Hugging Face's ``LlamaConfig``.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` (:attr:`head_size`
    is the value in use). ``rope_scaling`` is a :class:`RopeScaling` (a dict of its fields
    is converted) or ``None`` for plain rotary embeddings. ``dtype`` is the compute dtype
    (parameters are cast at use; logits are always float32), ``param_dtype`` the storage
    dtype. ``dropout`` applies to embeddings and residual branches, and only when
    ``Llama.__call__`` gets ``rngs``. ``remat`` is a policy of
    :data:`nnxscale.layers.stack.REMAT_POLICIES` (``True`` means ``"full"``); ``attention``
    an implementation of :func:`nnxscale.layers.attention.attention`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Optional[RopeScaling] = None
    tie_word_embeddings: bool = False
    dropout: float = 0.0
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attention: str = "auto"

    def __post_init__(self):
        self._check_training_fields()
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", parse_rope_scaling(self.rope_scaling, "LlamaConfig.rope_scaling"))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ModelError(f"LlamaConfig.rope_scaling must be a RopeScaling, a dict of its fields or None, got {self.rope_scaling!r}")
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings") + (("head_dim",) if self.head_dim is not None else ())  # fmt: skip
        self._check_positive_ints(sizes)
        N, K = self.num_attention_heads, self.num_key_value_heads
        if N % K:
            raise ModelError(
                f"LlamaConfig.num_attention_heads={N} is not a multiple of num_key_value_heads={K}: "
                "every K/V head serves the same number of query heads"
            )
        if self.head_dim is None and self.hidden_size % N:
            raise ModelError(
                f"LlamaConfig.hidden_size={self.hidden_size} is not divisible by num_attention_heads={N}: "
                "set head_dim, or make every head hidden_size // num_attention_heads wide"
            )
        if self.head_size % 2:
            raise ModelError(f"LlamaConfig head width {self.head_size} is odd: rotary embeddings turn pairs of dimensions")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ModelError(f"LlamaConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ModelError(f"LlamaConfig.tie_word_embeddings must be True or False, got {self.tie_word_embeddings!r}")

    @property
    def head_size(self) -> int:
        """The width of one attention head: ``head_dim``, or ``hidden_size // num_attention_heads``."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    def num_params(self) -> int:
        """Exact parameter count from the shapes; a tied output head counts once."""
        C, F, V = self.hidden_size, self.intermediate_size, self.vocab_size
        N, K, H = self.num_attention_heads, self.num_key_value_heads, self.head_size
        per_layer = (C * N * H + 2 * C * K * H + N * H * C) + 3 * C * F + 2 * C  # attention, SwiGLU, 2 RMSNorms
        return V * C * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer + C

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at context ``seq_len``: ``6*N + 12*L*n_heads*head_dim*seq_len``.

        ``N`` counts the parameters that multiply activations: all of them, less the input
        embedding when the head is untied (a lookup costs no FLOPs; tied, the matrix counts
        once, as the output head, as nanoGPT counts GPT-2's). 6N covers forward and backward
        matmuls; the second term the attention scores and weighted values over the query
        heads (grouped K/V heads save memory, not FLOPs), without halving for the causal mask.
        """
        n = self.num_params() - (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)
        return 6 * n + 12 * self.num_hidden_layers * self.num_attention_heads * self.head_size * int(seq_len)


def parse_rope_scaling(d: dict, where: str) -> RopeScaling:
    """A ``rope_scaling`` mapping (llama3's) as :class:`RopeScaling`; ``where`` names its
    source in the error for an unknown or missing key."""
    fields = [f.name for f in dataclasses.fields(RopeScaling)]
    extra = sorted(set(d) - set(fields) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    missing = [k for k in fields if k not in d]
    if extra or missing:
        raise ModelError(f"{where} needs exactly the fields {fields}; missing {missing}, unknown {extra}")
    return RopeScaling(**{k: d[k] for k in fields})


_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, num_key_value_heads=8)
_BYTES = dict(vocab_size=256, rope_theta=10000.0, tie_word_embeddings=True)
_SCALING_3_1 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_SCALING_3_2 = dataclasses.replace(_SCALING_3_1, factor=32.0)

#: Published shapes (vocabulary 128256, context 131072) and byte-level sizes for CPU runs
#: (every width, head count and K/V head count divides by 8).
PRESETS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": LlamaConfig(**_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, rope_scaling=_SCALING_3_2, tie_word_embeddings=True),
    "llama-3.2-3b": LlamaConfig(**_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                num_attention_heads=24, rope_scaling=_SCALING_3_2, tie_word_embeddings=True),
    "llama-3.1-8b": LlamaConfig(**_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, rope_scaling=_SCALING_3_1, tie_word_embeddings=False),
    "llama-tiny": LlamaConfig(**_BYTES, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=128),
    "llama-mini": LlamaConfig(**_BYTES, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=256),
}  # fmt: skip


def preset(name: str, **overrides) -> LlamaConfig:
    """The preset ``name`` with fields replaced by ``overrides`` (validated again)."""
    return choose_preset(PRESETS, "Llama", name, overrides)
