"""The mixtral modules, for one device, annotated with logical axis names: Llama's, with a
mixture of experts (:class:`nnxscale.layers.moe.MoE`) in place of each layer's MLP.
"""
from __future__ import annotations

import jax
from flax import nnx

from nnxscale.layers import lora
from nnxscale.layers.moe import MoE
from nnxscale.layers.stack import kept
from nnxscale.models.common.dropout import dropout
from nnxscale.models.llama.model import Llama, LlamaAttention, rms_norm
from nnxscale.models.mixtral.config import MixtralConfig
from nnxscale.sharding.activations import constrain


class MixtralDecoderLayer(nnx.Module):
    """Attention as Llama's, then ``block_sparse_moe``: returns ``(x, RouterStats)`` (or
    ``(x, cache)`` when decoding with a cache)."""

    def __init__(self, c: MixtralConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = rms_norm(c.hidden_size, c.rms_norm_eps, **kw)
        self.self_attn = LlamaAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size,
                                        impl=c.attention, **kw)  # fmt: skip
        self.post_attention_layernorm = rms_norm(c.hidden_size, c.rms_norm_eps, **kw)
        self.block_sparse_moe = MoE(c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                                    capacity_factor=c.capacity_factor, **kw)  # fmt: skip
        self.dropout = c.dropout

    def __call__(self, x, cos, sin, positions=None, segments=None, key=None, cache=None):  # x (B, T, C)
        x = constrain(x, "batch", "length", "embed")  # the residual stream
        if cache is not None:  # decoding (no dropout)
            a, cache = self.self_attn(self.input_layernorm(x), cos, sin, positions, cache=cache)
            x = x + a
            y = self.block_sparse_moe(self.post_attention_layernorm(x), dropless=True)[0]
            return constrain(x + y, "batch", "length", "embed"), cache
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        with lora.dropout_key(key):  # LoRA adapters' dropout (the attention's; the experts' are folded in: none)
            x = x + dropout(self.self_attn(self.input_layernorm(x), cos, sin, positions, segments), self.dropout, k1)
        y, stats = self.block_sparse_moe(self.post_attention_layernorm(x), positions=positions)
        x = x + dropout(kept(y, "mlp_output"), self.dropout, k2)  # kept: for --remat dots-except-mlp-in
        return constrain(x, "batch", "length", "embed"), stats


class Mixtral(Llama):
    """Mixtral language model: :class:`~nnxscale.models.llama.Llama` whose layers route each
    token to ``num_experts_per_tok`` of ``num_local_experts`` SwiGLU experts.

    ``hidden_states(..., with_stats=True)`` also returns every layer's router statistics,
    which the family's loss adds to the objective (load balance and z-loss).
    """

    layer_type = MixtralDecoderLayer
    routed = True

    def __init__(self, config: MixtralConfig, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
