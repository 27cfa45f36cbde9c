"""The decoder's modules, for one device, annotated with logical axis names: the norms, the
two attentions (grouped-query and DeepSeek's latent), the gated MLP, the layer that holds
them as a config says, and the group of layers a repeating pattern stacks.

Module and parameter names are Hugging Face's (``self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``, Gemma's ``pre_feedforward_layernorm``, DeepSeek's ``kv_a_proj_with_mqa``),
so a checkpoint maps by name; a mixture's experts are held stacked (``w1``, ``w3``, ``w2``).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscale.layers import kv_cache, lora
from nnxscale.layers.attention import attention as attend
from nnxscale.layers.mlp_chunks import chunked_mlp
from nnxscale.layers.moe import MoE, Router
from nnxscale.layers.stack import kept
from nnxscale.models.common.dropout import dropout
from nnxscale.models.decoder.config import DecoderConfig, LayerKind
from nnxscale.models.decoder.rope import YarnScaling, rotate, yarn_mscale
from nnxscale.sharding.activations import constrain
from nnxscale.sharding.rules import logical

_normal = nnx.initializers.normal(0.02)  # HF's initializer_range for every weight matrix
_ones = nnx.initializers.ones_init()
_zeros = nnx.initializers.zeros_init()

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class OffsetRMSNorm(nnx.Module):
    """Gemma's RMSNorm: the normalized input times ``1 + scale`` (``scale`` starts at 0),
    computed in float32 as Hugging Face's ``Gemma2RMSNorm``."""

    def __init__(self, size: int, eps: float, axis_name: str, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.scale = nnx.Param(logical(_zeros, axis_name)(rngs.params(), (size,), param_dtype))
        self.epsilon, self.dtype = eps, dtype

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
        return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(self.dtype)


def rms_norm(size: int, eps: float, dtype, param_dtype, rngs, *, offset: bool = False, axis_name: str = "embed"):
    """The decoder's RMSNorm over ``size`` features (its scale on ``axis_name``): Llama's, or
    Gemma's ``1 + w`` with ``offset``."""
    if offset:
        return OffsetRMSNorm(size, eps, axis_name, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    return nnx.RMSNorm(size, epsilon=eps, dtype=dtype, param_dtype=param_dtype, scale_init=logical(_ones, axis_name),
                       rngs=rngs)  # fmt: skip


def softmax_scale(c: DecoderConfig) -> float:
    """The attention's softmax scale: ``1/sqrt(head width)``, ``query_pre_attn_scalar**-0.5``
    (Gemma), times YaRN's ``mscale(factor, mscale_all_dim)**2`` for latent attention (DeepSeek)."""
    scale = (c.query_pre_attn_scalar or c.head_size) ** -0.5
    s = c.rope_scaling
    if c.latent and isinstance(s, YarnScaling) and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


def _switches(impl: str, window: Optional[int], softcap, scale, head: int) -> dict:
    """The keyword arguments of the attention beyond the defaults (none for a plain layer)."""
    kw = {"impl": impl}
    if window is not None:
        kw["window"] = window
    if softcap is not None:
        kw["softcap"] = softcap
    if scale != head**-0.5:
        kw["scale"] = scale
    return kw


def _attend_or_cache(module, q, k, v, positions, segments, cache):
    """The attention of ``q, k, v``: over the sequence in training, over the cache when decoding."""
    kw = _switches(module.impl, module.window, module.softcap, module.scale, q.shape[-1])
    if cache is not None:  # decoding: positions (B, T) index the cache (nnxscale.layers.kv_cache)
        y, cache = kv_cache.step(cache, q, k, v, positions, **kw)
        return constrain(y, "batch", "length", "heads", "kv"), cache
    # grouped-query attention: query head n reads K/V head n // (N // K), as HF's repeat_kv
    y = attend(q, k, v, causal=True, q_positions=positions, k_positions=positions, q_segments=segments,
               k_segments=segments, **kw)  # fmt: skip
    return constrain(y, "batch", "length", "heads", "kv"), None


class Attention(nnx.Module):
    """Grouped-query attention with the switches of :class:`DecoderConfig`: q/k/v biases,
    per-head q/k norms, a sliding window, logit soft-capping and the softmax scale."""

    def __init__(self, c: DecoderConfig, kind: LayerKind = LayerKind(None, False), *, dtype, param_dtype,
                 rngs: nnx.Rngs):  # fmt: skip
        C, N, K, H = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size
        self.impl = c.attention  # the attention implementation (nnxscale.layers.attention)
        self.window, self.softcap, self.scale = kind.window, c.attn_logit_softcapping, softmax_scale(c)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        def proj(heads, name):
            bias = dict(bias_shape=(heads, H), bias_init=logical(_zeros, name, "kv")) if c.qkv_bias else {}
            return nnx.Einsum("btc,cnh->btnh", (C, heads, H), kernel_init=logical(_normal, "embed", name, "kv"), **bias, **kw)

        self.q_proj, self.k_proj, self.v_proj = proj(N, "heads"), proj(K, "kv_heads"), proj(K, "kv_heads")
        bias = dict(bias_shape=(C,), bias_init=logical(_zeros, "embed")) if c.o_bias else {}
        self.o_proj = nnx.Einsum("btnh,nhc->btc", (N, H, C), kernel_init=logical(_normal, "heads", "kv", "embed"), **bias, **kw)
        if c.qk_norm:
            self.q_norm = rms_norm(H, c.rms_norm_eps, offset=c.norm_offset, axis_name="kv", **kw)
            self.k_norm = rms_norm(H, c.rms_norm_eps, offset=c.norm_offset, axis_name="kv", **kw)

    def __call__(self, x, cos, sin, positions=None, segments=None, cache=None):  # x (B, T, C); cos, sin ([B,] T, H)
        # kept(...): what --remat dots-except-mlp-in keeps for the backward pass (nnxscale.layers.stack)
        q, k, v = (kept(p(x), "attention_projection") for p in (self.q_proj, self.k_proj, self.v_proj))
        if hasattr(self, "q_norm"):  # per head, before the rotation (Qwen3, Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(rotate(q, cos, sin), "batch", "length", "heads", "kv")  # (B, T, N, H)
        k = constrain(rotate(k, cos, sin), "batch", "length", "kv_heads", "kv")  # (B, T, K, H)
        v = constrain(v, "batch", "length", "kv_heads", "kv")  # (B, T, K, H)
        y, cache = _attend_or_cache(self, q, k, v, positions, segments, cache)
        out = kept(self.o_proj(y), "attention_output")  # (B, T, C)
        return out if cache is None else (out, cache)


class LatentAttention(nnx.Module):
    """DeepSeek's multi-head latent attention (DeepSeek-V2, section 2.1): queries through a
    low-rank bottleneck (or one projection), keys and values from a shared latent of
    ``kv_lora_rank``; each head's query and key is a part without rotation and a rotated
    part, the key's rotated part shared by every head. The cache holds the up-projected
    keys and values (not the latent)."""

    def __init__(self, c: DecoderConfig, kind: LayerKind = LayerKind(None, False), *, dtype, param_dtype,
                 rngs: nnx.Rngs):  # fmt: skip
        C, N, H, Hv, r = c.hidden_size, c.num_attention_heads, c.head_size, c.value_size, c.kv_lora_rank
        self.impl, self.window, self.softcap, self.scale = c.attention, kind.window, None, softmax_scale(c)
        self.nope, self.interleaved = c.qk_nope_head_dim, c.rope_interleave
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = lambda n: rms_norm(n, c.rms_norm_eps, axis_name=None, **kw)  # noqa: E731  (a latent: whole on every device)
        heads = lambda n_in, width, name_in: nnx.Einsum("btc,cnh->btnh", (n_in, N, width),  # noqa: E731
                                                        kernel_init=logical(_normal, name_in, "heads", "kv"), **kw)  # fmt: skip
        if c.q_lora_rank is None:
            self.q_proj = heads(C, H, "embed")
        else:
            self.q_a_proj = nnx.Linear(C, c.q_lora_rank, use_bias=False, kernel_init=logical(_normal, "embed", None), **kw)
            self.q_a_layernorm = norm(c.q_lora_rank)
            # the latent axis takes FSDP's split (its rules shard "embed" parameters): the
            # up-projections are latent attention's largest weights and hold no embed axis
            self.q_b_proj = heads(c.q_lora_rank, H, "embed")
        self.kv_a_proj_with_mqa = nnx.Linear(C, r + c.qk_rope_head_dim, use_bias=False,
                                             kernel_init=logical(_normal, "embed", None), **kw)  # fmt: skip
        self.kv_a_layernorm = norm(r)
        self.kv_b_proj = heads(r, c.qk_nope_head_dim + Hv, "embed")
        self.o_proj = nnx.Einsum("btnh,nhc->btc", (N, Hv, C), kernel_init=logical(_normal, "heads", "kv", "embed"), **kw)

    def __call__(self, x, cos, sin, positions=None, segments=None, cache=None):  # cos, sin ([B,] T, qk_rope_head_dim)
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = kept(q, "attention_projection")  # (B, T, N, nope + rope)
        latent = kept(self.kv_a_proj_with_mqa(x), "attention_projection")  # (B, T, r + rope)
        r = self.kv_a_layernorm.num_features
        kv = self.kv_b_proj(self.kv_a_layernorm(latent[..., :r]))  # (B, T, N, nope + Hv)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        q_rot = rotate(q[..., self.nope :], cos, sin, interleaved=self.interleaved)
        k_rot = rotate(latent[..., None, r:], cos, sin, interleaved=self.interleaved)  # (B, T, 1, rope): every head's
        q = constrain(jnp.concatenate([q[..., : self.nope], q_rot], axis=-1), "batch", "length", "heads", "kv")
        k_rot = jnp.broadcast_to(k_rot, k_nope.shape[:-1] + k_rot.shape[-1:])
        k = constrain(jnp.concatenate([k_nope, k_rot], axis=-1), "batch", "length", "heads", "kv")
        v = constrain(v, "batch", "length", "heads", "kv")
        y, cache = _attend_or_cache(self, q, k, v, positions, segments, cache)
        out = kept(self.o_proj(y), "attention_output")
        return out if cache is None else (out, cache)


class MLP(nnx.Module):
    """The gated MLP ``down(act(gate(x)) * up(x))``: SwiGLU (Llama, Qwen, Mistral, DeepSeek's
    dense layers) or GeGLU with tanh GELU (Gemma)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, param_dtype, rngs: nnx.Rngs,
                 act: str = "silu"):  # fmt: skip
        C, F = hidden_size, intermediate_size
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.act = act
        self.gate_proj = nnx.Linear(C, F, kernel_init=logical(_normal, "embed", "mlp"), **kw)
        self.up_proj = nnx.Linear(C, F, kernel_init=logical(_normal, "embed", "mlp"), **kw)
        self.down_proj = nnx.Linear(F, C, kernel_init=logical(_normal, "mlp", "embed"), **kw)

    def __call__(self, x):  # (B, T, C)
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        act = ACTIVATIONS[self.act]
        # LoRA adapters (nnxscale.layers.lora), each with its own matrix that has the intermediate axis: B of gate
        # and up (r, F), A of down (F, r); sliced with the weights, so x @ A_gate is recomputed per slice.
        adapters = [lora.adapter(m) for m in (gate, up, down)]
        parts = [(a.b[...], 1) if i < 2 else (a.a[...], 0) for i, a in enumerate(adapters) if a is not None]

        def mlp(x, w_gate, w_up, w_down, *sliced):  # each projection as its nnx.Linear computes it, with the weight given
            it = iter(sliced)

            def dense(layer, a, x, w):
                y = _dense(layer, x, w)
                if a is None:
                    return y
                part = next(it)
                return y + (a.delta(x, y.dtype, b=part) if layer is not down else a.delta(x, y.dtype, a=part))

            h = act(dense(gate, adapters[0], x, w_gate)) * dense(up, adapters[1], x, w_up)
            return dense(down, adapters[2], constrain(h, "batch", "length", "mlp"), w_down)  # (B, T, F) -> (B, T, C)

        weights = [(gate.kernel[...], 1), (up.kernel[...], 1), (down.kernel[...], 0)]  # each with its intermediate axis
        y = chunked_mlp(mlp, x, weights + parts, up.out_features)  # long sequences: in slices of the intermediate
        return kept(y, "mlp_output")


def _dense(layer: nnx.Linear, x, w):
    """``layer(x)`` with the kernel ``w`` (no bias): what ``nnx.Linear.__call__`` computes."""
    x, w, _ = layer.promote_dtype((x, w, None), dtype=layer.dtype)
    return layer.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=layer.precision)


def router_of(c: DecoderConfig) -> Router:
    return Router(scoring=c.router_scoring, norm_topk_prob=c.norm_topk_prob, n_group=c.n_group,
                  topk_group=c.topk_group, routed_scaling_factor=float(c.routed_scaling_factor),
                  score_bias=c.router_score_bias, group_top=c.router_group_top)  # fmt: skip


class DecoderLayer(nnx.Module):
    """One layer: the attention and the MLP (or mixture of experts), each a residual branch
    behind an RMSNorm; with ``sandwich_norms`` (Gemma 2/3) each branch's output is normed too.

    Returns ``x``; a mixture's layer returns ``(x, RouterStats)``; decoding with a cache
    returns ``(x, cache)``.
    """

    def __init__(self, c: DecoderConfig, kind: LayerKind = LayerKind(None, False), *, dtype, param_dtype,
                 rngs: nnx.Rngs):  # fmt: skip
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = lambda: rms_norm(c.hidden_size, c.rms_norm_eps, offset=c.norm_offset, **kw)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = (LatentAttention if c.latent else Attention)(c, kind, **kw)
        self.post_attention_layernorm = norm()  # Llama's: before the MLP; Gemma's: after the attention
        if c.sandwich_norms:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.routed = kind.moe
        self.mlp_name = getattr(c, "moe_name", "mlp") if kind.moe else "mlp"
        if kind.moe:
            moe = MoE(c.hidden_size, c.expert_size, c.num_local_experts, c.num_experts_per_tok,
                      capacity_factor=c.capacity_factor, router=router_of(c),
                      shared=c.n_shared_experts * c.expert_size, **kw)  # fmt: skip
            setattr(self, self.mlp_name, moe)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, act=c.hidden_act, **kw)
        self.dropout = c.dropout

    def _mlp_branch(self, x, positions, dropless: bool):
        """``(the MLP's output, router statistics or None)`` for the normed input ``x``."""
        if not self.routed:
            return self.mlp(x), None
        y, stats = getattr(self, self.mlp_name)(x, dropless=True) if dropless else getattr(self, self.mlp_name)(x, positions=positions)
        return kept(y, "mlp_output"), stats  # kept: for --remat dots-except-mlp-in

    def _branches(self, x, cos, sin, positions, segments, cache, keys):
        sandwich = hasattr(self, "pre_feedforward_layernorm")
        out = self.self_attn(self.input_layernorm(x), cos, sin, positions, segments, cache=cache)
        a, cache = out if cache is not None else (out, None)
        if sandwich:
            a = self.post_attention_layernorm(a)
        x = x + dropout(a, self.dropout, keys[0])
        h = self.pre_feedforward_layernorm(x) if sandwich else self.post_attention_layernorm(x)
        y, stats = self._mlp_branch(h, positions, dropless=cache is not None)
        if sandwich:
            y = self.post_feedforward_layernorm(y)
        return constrain(x + dropout(y, self.dropout, keys[1]), "batch", "length", "embed"), stats, cache

    def __call__(self, x, cos, sin, cos_local=None, sin_local=None, positions=None, segments=None, key=None, cache=None):
        if self.self_attn.window is not None and cos_local is not None:  # the sliding layers' own rotation
            cos, sin = cos_local, sin_local
        x = constrain(x, "batch", "length", "embed")  # the residual stream
        if cache is not None:  # decoding (no dropout)
            x, _, cache = self._branches(x, cos, sin, positions, None, cache, (None, None))
            return x, cache
        keys = (None, None) if key is None else tuple(jax.random.split(key))
        with lora.dropout_key(key):  # LoRA adapters' dropout, when they have one
            x, stats, _ = self._branches(x, cos, sin, positions, segments, None, keys)
        return (x, stats) if self.routed else x


class LayerGroup(nnx.Module):
    """Consecutive layers of different kinds (``layer_0``, ``layer_1``, ...) run as one: a
    repeating pattern stacked and scanned as groups, so the compiled body is one group
    (Gemma 3's five sliding layers and one global), not every layer. Returns what a layer
    returns, router statistics stacked over the group's routed layers."""

    def __init__(self, c: DecoderConfig, kinds: tuple[LayerKind, ...], *, dtype, param_dtype, rngs: nnx.Rngs):
        self.size = len(kinds)
        self.routed = any(k.moe for k in kinds)
        for j, kind in enumerate(kinds):
            setattr(self, f"layer_{j}", DecoderLayer(c, kind, dtype=dtype, param_dtype=param_dtype, rngs=rngs))

    def members(self) -> list[DecoderLayer]:
        return [getattr(self, f"layer_{j}") for j in range(self.size)]

    def __call__(self, x, *args, key=None, cache=None):
        if cache is not None:
            new = {}
            for j, layer in enumerate(self.members()):
                x, new[f"layer_{j}"] = layer(x, *args, cache=cache[f"layer_{j}"])
            return x, new
        keys = [None] * self.size if key is None else list(jax.random.split(key, self.size))
        stats = []
        for layer, k in zip(self.members(), keys):
            out = layer(x, *args, key=k)
            x, s = out if layer.routed else (out, None)
            if s is not None:
                stats.append(s)
        if not self.routed:
            return x
        return x, jax.tree.map(lambda *a: jnp.stack(a), *stats)
