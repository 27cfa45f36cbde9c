"""The gpt2 config and its presets.
"""
from __future__ import annotations

import dataclasses

from flax import nnx

from nnxscale.errors import ModelError
from nnxscale.models.common.model_config import ModelConfig, choose_preset

_normal = nnx.initializers.normal
_zeros = nnx.initializers.zeros_init()
_ones = nnx.initializers.ones_init()


@dataclasses.dataclass(frozen=True)
class GPT2Config(ModelConfig):
    """GPT-2 hyperparameters.

    ``dtype`` is the compute dtype (parameters are cast at use; logits are always
    float32), ``param_dtype`` the storage dtype of the parameters. ``dropout`` applies to
    embeddings and residual branches, and only when ``GPT2.__call__`` gets ``rngs``.
    ``remat`` is a policy of :data:`nnxscale.layers.stack.REMAT_POLICIES` (``"none"``,
    ``"full"``: keep each block's input only, ``"dots"``: keep the weight matmuls'
    outputs, ``"dots-except-mlp-in"``: those but ``c_fc``'s); ``True`` means ``"full"``.
    ``attention`` is an implementation of :func:`nnxscale.layers.attention.attention`
    (``"auto"``, ``"xla"``, ``"blockwise"``, ``"cudnn"``).
    """

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    dropout: float = 0.0
    layer_norm_epsilon: float = 1e-5
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attention: str = "auto"

    def __post_init__(self):
        self._check_training_fields()
        self._check_positive_ints(("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"))
        if self.n_embd % self.n_head:
            raise ModelError(
                f"GPT2Config.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                "every head needs the same width n_embd // n_head"
            )
        if not self.layer_norm_epsilon > 0:
            raise ModelError(f"GPT2Config.layer_norm_epsilon must be positive, got {self.layer_norm_epsilon!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_params(self) -> int:
        """Exact parameter count from the shapes; the tied output head counts once."""
        C, L = self.n_embd, self.n_layer
        per_block = (2 * C) + (C * 3 * C + 3 * C) + (C * C + C) + (2 * C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
        return self.vocab_size * C + self.n_positions * C + L * per_block + 2 * C

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at context ``seq_len``, nanoGPT's convention.

        ``6*N + 12*n_layer*n_embd*seq_len`` with ``N`` the parameters excluding the
        position embedding (nanoGPT's ``estimate_mfu``): 6N for the forward and backward
        matmuls, the second term for attention scores and weighted values. llm.c uses
        ``6*L*C*T`` for the attention term instead; say which one a reported MFU uses.
        """
        n = self.num_params() - self.n_positions * self.n_embd
        return 6 * n + 12 * self.n_layer * self.n_embd * int(seq_len)


_HF = dict(vocab_size=50257, n_positions=1024)
_BYTES = dict(vocab_size=256)

#: Published sizes (vocabulary 50257, context 1024) and byte-level sizes for CPU runs.
PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(**_HF, n_embd=768, n_layer=12, n_head=12),
    "gpt2-medium": GPT2Config(**_HF, n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": GPT2Config(**_HF, n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": GPT2Config(**_HF, n_embd=1600, n_layer=48, n_head=25),
    "gpt2-tiny": GPT2Config(**_BYTES, n_positions=128, n_embd=64, n_layer=2, n_head=8),
    "gpt2-mini": GPT2Config(**_BYTES, n_positions=256, n_embd=128, n_layer=4, n_head=8),
}


def preset(name: str, **overrides) -> GPT2Config:
    """The preset ``name`` with fields replaced by ``overrides`` (validated again)."""
    return choose_preset(PRESETS, "GPT-2", name, overrides)
