"""The mixtral config and its presets.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from nnxscale.errors import ModelError
from nnxscale.models.common.model_config import choose_preset
from nnxscale.models.llama.config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """Mixtral hyperparameters, named as in Hugging Face's ``MixtralConfig``: Llama's
    attention and norms, and in every layer ``num_local_experts`` SwiGLU experts of width
    ``intermediate_size``, of which a router picks ``num_experts_per_tok`` per token (their
    weights renormalized over the chosen ones). ``router_aux_loss_coef`` weighs the
    Switch-Transformer load-balancing loss, ``router_z_loss_coef`` the router z-loss
    (ST-MoE), both added to the training objective.
    """

    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.02
    router_z_loss_coef: float = 0.001
    rope_theta: float = 1000000.0
    #: None: dropless (Mixtral's routing, Hugging Face's logits). A factor: each expert takes
    #: at most factor x its even share of a sequence's assignments in training; the rest
    #: are dropped (:func:`nnxscale.layers.moe.capacity`). Not a Hugging Face field.
    capacity_factor: Optional[float] = None

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints(("num_local_experts", "num_experts_per_tok"))
        if self.num_experts_per_tok > self.num_local_experts:
            raise ModelError(
                f"MixtralConfig.num_experts_per_tok={self.num_experts_per_tok} is larger than "
                f"num_local_experts={self.num_local_experts}: a token cannot pick more experts than there are"
            )
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            raise ModelError(f"MixtralConfig.capacity_factor must be a positive number (or None: dropless), got {cf!r}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ModelError(f"MixtralConfig.{name} must be a non-negative number, got {value!r}")

    def _layer_params(self, experts: int) -> int:
        C, F = self.hidden_size, self.intermediate_size
        N, K, H = self.num_attention_heads, self.num_key_value_heads, self.head_size
        attention = C * N * H + 2 * C * K * H + N * H * C
        return attention + C * self.num_local_experts + experts * 3 * C * F + 2 * C  # router, experts, 2 RMSNorms

    def num_params(self) -> int:
        """Exact parameter count from the shapes; a tied output head counts once."""
        V, C = self.vocab_size, self.hidden_size
        heads = V * C * (1 if self.tie_word_embeddings else 2)
        return heads + self.num_hidden_layers * self._layer_params(self.num_local_experts) + C

    def active_params(self) -> int:
        """Parameters one token uses: every expert but the ``num_experts_per_tok`` it is routed to left out."""
        V, C = self.vocab_size, self.hidden_size
        heads = V * C * (1 if self.tie_word_embeddings else 2)
        return heads + self.num_hidden_layers * self._layer_params(self.num_experts_per_tok) + C

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at context ``seq_len``: Llama's formula over the active
        parameters (a token runs through ``num_experts_per_tok`` experts, not all of them)."""
        n = self.active_params() - (0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size)
        return 6 * n + 12 * self.num_hidden_layers * self.num_attention_heads * self.head_size * int(seq_len)


_BYTES = dict(vocab_size=256, rope_theta=10000.0, tie_word_embeddings=True)

#: The published Mixtral 8x7B shape (46,702,792,704 parameters, 12,879,925,248 active per
#: token) and byte-level sizes for CPU runs (every width, head count, K/V head count and
#: expert count divides by 8 or 4).
PRESETS: dict[str, MixtralConfig] = {
    "mixtral-8x7b": MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                                  num_local_experts=8, num_experts_per_tok=2),
    "mixtral-tiny": MixtralConfig(**_BYTES, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                                  num_local_experts=8, num_experts_per_tok=2),
    "mixtral-mini": MixtralConfig(**_BYTES, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                  num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=256,
                                  num_local_experts=8, num_experts_per_tok=2),
}  # fmt: skip


def preset(name: str, **overrides) -> MixtralConfig:
    """The preset ``name`` with fields replaced by ``overrides`` (validated again)."""
    return choose_preset(PRESETS, "Mixtral", name, overrides)
