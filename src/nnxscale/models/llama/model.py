"""The llama modules, for one device, annotated with logical axis names.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxscale.errors import ModelError
from nnxscale.layers import kv_cache, lora
from nnxscale.layers.attention import attention as attend
from nnxscale.layers.stack import Rows, kept, scan_layers, stack_layers
from nnxscale.layers.mlp_chunks import chunked_mlp
from nnxscale.models.common.documents import layer_args
from nnxscale.models.common.dropout import dropout, dropout_keys
from nnxscale.models.llama.config import LlamaConfig, RopeScaling
from nnxscale.sharding.activations import constrain
from nnxscale.sharding.rules import logical

_normal = nnx.initializers.normal(0.02)  # HF's initializer_range for every weight matrix
_ones = nnx.initializers.ones_init()


def rope_frequencies(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> np.ndarray:
    """Rotary inverse frequencies ``(head_dim // 2,)``, with Llama 3's scaling (HF's
    ``_compute_llama3_parameters``), in float64."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if scaling is None:
        return inv_freq
    old = scaling.original_max_position_embeddings
    wavelen = 2 * np.pi / inv_freq
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    mixed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return np.where(wavelen < old / scaling.high_freq_factor, inv_freq,
                    np.where(wavelen > old / scaling.low_freq_factor, inv_freq / scaling.factor, mixed))  # fmt: skip


def _rotate(x, cos, sin):
    """Rotary embedding in HF's layout: dimension ``i`` pairs with ``i + H/2`` (``rotate_half``)."""
    x1, x2 = jnp.split(x, 2, axis=-1)  # each (B, T, N, H/2)
    rotated = jnp.concatenate([-x2, x1], axis=-1)  # (B, T, N, H)
    cos, sin = cos[..., None, :].astype(x.dtype), sin[..., None, :].astype(x.dtype)  # ([B,] T, 1, H)
    return x * cos + rotated * sin


def rms_norm(hidden_size, eps, dtype, param_dtype, rngs):
    """Llama's RMSNorm (the families built on Llama's block share it), its scale on ``embed``."""
    return nnx.RMSNorm(
        hidden_size, epsilon=eps, dtype=dtype, param_dtype=param_dtype, scale_init=logical(_ones, "embed"), rngs=rngs
    )


class LlamaAttention(nnx.Module):
    def __init__(self, hidden_size: int, n_heads: int, n_kv_heads: int, head_dim: int, *, impl: str = "auto", dtype,
                 param_dtype, rngs: nnx.Rngs):  # fmt: skip
        C, N, K, H = hidden_size, n_heads, n_kv_heads, head_dim
        self.impl = impl  # the attention implementation (nnxscale.layers.attention)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        proj = lambda heads, name: nnx.Einsum("btc,cnh->btnh", (C, heads, H), kernel_init=logical(_normal, "embed", name, "kv"), **kw)  # noqa: E731
        self.q_proj = proj(N, "heads")
        self.k_proj = proj(K, "kv_heads")
        self.v_proj = proj(K, "kv_heads")
        self.o_proj = nnx.Einsum("btnh,nhc->btc", (N, H, C), kernel_init=logical(_normal, "heads", "kv", "embed"), **kw)

    def __call__(self, x, cos, sin, positions=None, segments=None, cache=None):  # x (B, T, C); cos, sin ([B,] T, H); see Llama.hidden_states
        # kept(...): what --remat dots-except-mlp-in keeps for the backward pass (nnxscale.layers.stack)
        q, k, v = (kept(p(x), "attention_projection") for p in (self.q_proj, self.k_proj, self.v_proj))
        q = constrain(_rotate(q, cos, sin), "batch", "length", "heads", "kv")  # (B, T, N, H)
        k = constrain(_rotate(k, cos, sin), "batch", "length", "kv_heads", "kv")  # (B, T, K, H)
        v = constrain(v, "batch", "length", "kv_heads", "kv")  # (B, T, K, H)
        if cache is not None:  # decoding: positions (B, T) index the cache (nnxscale.layers.kv_cache)
            k, v, cache = kv_cache.write(cache, k, v, positions)
            y = constrain(kv_cache.attend(q, k, v, positions, impl=self.impl), "batch", "length", "heads", "kv")
            return self.o_proj(y), cache
        # grouped-query attention: query head n reads K/V head n // (N // K), as HF's repeat_kv
        y = attend(q, k, v, causal=True, q_positions=positions, k_positions=positions, q_segments=segments,
                   k_segments=segments, impl=self.impl)  # fmt: skip  (B, T, N, H)
        y = constrain(y, "batch", "length", "heads", "kv")
        return kept(self.o_proj(y), "attention_output")  # (B, T, C)


class LlamaMLP(nnx.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        C, F = hidden_size, intermediate_size
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(C, F, kernel_init=logical(_normal, "embed", "mlp"), **kw)
        self.up_proj = nnx.Linear(C, F, kernel_init=logical(_normal, "embed", "mlp"), **kw)
        self.down_proj = nnx.Linear(F, C, kernel_init=logical(_normal, "mlp", "embed"), **kw)

    def __call__(self, x):  # (B, T, C)
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
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

            h = jax.nn.silu(dense(gate, adapters[0], x, w_gate)) * dense(up, adapters[1], x, w_up)
            return dense(down, adapters[2], constrain(h, "batch", "length", "mlp"), w_down)  # (B, T, F) -> (B, T, C)

        weights = [(gate.kernel[...], 1), (up.kernel[...], 1), (down.kernel[...], 0)]  # each with its intermediate axis
        y = chunked_mlp(mlp, x, weights + parts, up.out_features)  # long sequences: in slices of the intermediate
        return kept(y, "mlp_output")


def _dense(layer: nnx.Linear, x, w):
    """``layer(x)`` with the kernel ``w`` (no bias): what ``nnx.Linear.__call__`` computes."""
    x, w, _ = layer.promote_dtype((x, w, None), dtype=layer.dtype)
    return layer.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=layer.precision)


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, c: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = rms_norm(c.hidden_size, c.rms_norm_eps, **kw)
        self.self_attn = LlamaAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size,
                                        impl=c.attention, **kw)  # fmt: skip
        self.post_attention_layernorm = rms_norm(c.hidden_size, c.rms_norm_eps, **kw)
        self.mlp = LlamaMLP(c.hidden_size, c.intermediate_size, **kw)
        self.dropout = c.dropout

    def __call__(self, x, cos, sin, positions=None, segments=None, key=None, cache=None):  # x (B, T, C)
        if cache is not None:  # decoding (no dropout): returns (x, cache)
            x = constrain(x, "batch", "length", "embed")
            a, cache = self.self_attn(self.input_layernorm(x), cos, sin, positions, cache=cache)
            x = x + a
            return constrain(x + self.mlp(self.post_attention_layernorm(x)), "batch", "length", "embed"), cache
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        x = constrain(x, "batch", "length", "embed")  # the residual stream
        with lora.dropout_key(key):  # LoRA adapters' dropout, when they have one
            x = x + dropout(self.self_attn(self.input_layernorm(x), cos, sin, positions, segments), self.dropout, k1)
            x = x + dropout(self.mlp(self.post_attention_layernorm(x)), self.dropout, k2)
        return constrain(x, "batch", "length", "embed")


class Llama(nnx.Module):
    """Llama language model; the output head is the token embedding when
    ``config.tie_word_embeddings``, else its own ``lm_head``.

    The state is parameters only (no RNG state): dropout randomness comes from the
    ``rngs`` argument of each call.
    """

    #: The decoder layer; a layer returning ``(x, router statistics)`` sets :attr:`routed`.
    layer_type = LlamaDecoderLayer
    #: Whether every layer routes tokens to experts and returns its statistics (Mixtral).
    routed = False

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        kw = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype), rngs=rngs)
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, embedding_init=logical(_normal, "vocab", "embed"), **kw)
        layer = partial(self.layer_type, c)
        self.layers = stack_layers(lambda rngs: layer(**(kw | {"rngs": rngs})), c.num_hidden_layers, rngs=rngs)
        self.norm = rms_norm(c.hidden_size, c.rms_norm_eps, **kw)
        if not c.tie_word_embeddings:
            self.lm_head = nnx.Linear(
                c.hidden_size, c.vocab_size, use_bias=False, kernel_init=logical(_normal, "embed", "vocab"), **kw
            )  # fmt: skip

    def __call__(self, tokens, *, rngs: Optional[nnx.Rngs] = None):
        """``tokens`` int (B, T) -> float32 logits (B, T, vocab_size).

        Dropout (embeddings and residual branches) is applied only when ``rngs`` is given
        and ``config.dropout > 0``; its key comes from the ``dropout`` stream (or ``default``).
        """
        return self.logits(self.hidden_states(tokens, rngs=rngs))

    def hidden_states(self, tokens, *, rngs: Optional[nnx.Rngs] = None, positions=None, segments=None, cache=None,
                      with_stats: bool = False):  # fmt: skip
        """``tokens`` int (B, T) -> the final norm's output (B, T, hidden_size), before the head.

        ``positions`` (T,) or (B, T) ints: each token's place in its sequence, for RoPE and
        the causal mask (default ``0..T-1``): given when ``tokens`` are stored out of order
        (a zigzag layout over a ``context`` axis) or hold several documents, each starting at 0.
        ``segments`` (B, T) ints: document ids; a token attends only within its document.
        ``cache``: decoding (no dropout): a cache from :meth:`init_cache`, ``positions``
        ``(B, T)`` contiguous in each row; returns ``(hidden states, updated cache)``.
        ``with_stats`` (a routed model): returns ``(hidden states, router statistics of every
        layer)`` (:class:`nnxscale.layers.moe.RouterStats`, each field with a leading layers axis).
        """
        c = self.config
        T = tokens.shape[1]
        if T > c.max_position_embeddings:
            raise ModelError(f"sequence length {T} exceeds the context max_position_embeddings={c.max_position_embeddings}")
        embed_key, layer_keys = dropout_keys(rngs, max(c.dropout, lora.dropout_rate(self)), c.num_hidden_layers)
        inv_freq = rope_frequencies(c.head_size, c.rope_theta, c.rope_scaling).astype(np.float32)  # (H/2,)
        where = jnp.arange(T) if positions is None else positions
        angles = where.astype(jnp.float32)[..., None] * inv_freq  # ([B,] T, H/2)
        angles = jnp.concatenate([angles, angles], axis=-1)  # ([B,] T, H): HF's rotate_half layout
        tables = (jnp.cos(angles), jnp.sin(angles))
        if cache is not None:
            x = constrain(self.embed_tokens(tokens), "batch", "length", "embed")
            x, cache = scan_layers(self.layers, x, *tables, positions, cache=cache)
            return self.norm(x), cache
        x = dropout(constrain(self.embed_tokens(tokens), "batch", "length", "embed"), c.dropout, embed_key)  # (B, T, C)
        if positions is not None and jnp.ndim(positions) == 2:  # per row: split with the batch in a pipeline
            tables = tuple(Rows(t) for t in tables)
        args = (*tables, *layer_args(positions, segments))
        x = scan_layers(self.layers, x, *args, keys=layer_keys, remat=c.remat, aux=self.routed)
        if self.routed:
            x, stats = x
            return (self.norm(x), stats) if with_stats else self.norm(x)
        return self.norm(x)

    def init_cache(self, batch: int, length: int) -> dict:
        """An empty decoding cache for ``batch`` rows of up to ``length`` positions (at most
        ``max_position_embeddings``), laid out by the activation rules in force."""
        c = self.config
        return kv_cache.empty(c.num_hidden_layers, batch, length, c.num_key_value_heads, c.head_size, jnp.dtype(c.dtype))

    def head(self):
        """The output head's weight (hidden_size, vocab_size), in the parameters' dtype: the
        token embedding's transpose when tied, else ``lm_head``'s kernel."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.embedding[...].T
        return self.lm_head.kernel[...]

    def logits(self, x):
        """The output head: (B, T, hidden_size) -> float32 logits (B, T, vocab_size)."""
        logits = jnp.einsum("btc,cv->btv", x, self.head().astype(x.dtype), preferred_element_type=jnp.float32)
        return constrain(logits, "batch", "length", "vocab")  # (B, T, V)
