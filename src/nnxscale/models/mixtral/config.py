"""The mixtral config and its presets.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from nnxscale.models.common.model_config import choose_preset
from nnxscale.models.llama.config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """Mixtral hyperparameters, named as in Hugging Face's ``MixtralConfig``: Llama's
    attention and norms, and in every layer ``num_local_experts`` SwiGLU experts of width
    ``intermediate_size``, of which a router picks ``num_experts_per_tok`` per token (their
    weights renormalized over the chosen ones). ``router_aux_loss_coef`` weighs the
    Switch-Transformer load-balancing loss, ``router_z_loss_coef`` the router z-loss
    (ST-MoE), both added to the training objective. ``capacity_factor`` (not a Hugging Face
    field): None is dropless (Mixtral's routing, Hugging Face's logits); a factor lets each
    expert take at most factor x its even share of a sequence's assignments in training,
    the rest dropped (:func:`nnxscale.layers.moe.capacity`).
    """

    #: The layer's attribute holding the mixture (Hugging Face's name in this family).
    moe_name: ClassVar[str] = "block_sparse_moe"

    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.02
    router_z_loss_coef: float = 0.001
    rope_theta: float = 1000000.0

    def __post_init__(self):
        super().__post_init__()
        self._check_positive_ints(("num_local_experts",))


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
