"""The gpt2 modules, for one device, annotated with logical axis names.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscale.errors import ModelError
from nnxscale.layers import kv_cache, lora
from nnxscale.layers.attention import attention as attend
from nnxscale.layers.stack import kept, scan_layers, stack_layers
from nnxscale.models.common.documents import layer_args
from nnxscale.models.common.dropout import dropout, dropout_keys
from nnxscale.models.gpt2.config import GPT2Config
from nnxscale.sharding.activations import constrain
from nnxscale.sharding.rules import logical

_normal = nnx.initializers.normal
_zeros = nnx.initializers.zeros_init()
_ones = nnx.initializers.ones_init()


def _layer_norm(n_embd, eps, dtype, param_dtype, rngs):
    return nnx.LayerNorm(
        n_embd, epsilon=eps, use_fast_variance=False, dtype=dtype, param_dtype=param_dtype,
        scale_init=logical(_ones, "embed"), bias_init=logical(_zeros, "embed"), rngs=rngs,
    )  # fmt: skip


class CausalSelfAttention(nnx.Module):
    def __init__(self, n_embd: int, n_head: int, *, proj_std: float, impl: str = "auto", dtype, param_dtype, rngs: nnx.Rngs):
        N, H = n_head, n_embd // n_head
        self.impl = impl  # the attention implementation (nnxscale.layers.attention)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.c_attn = nnx.Einsum(
            "btc,cknh->btknh", (n_embd, 3, N, H), (3, N, H),
            kernel_init=logical(_normal(0.02), "embed", None, "heads", "kv"),
            bias_init=logical(_zeros, None, "heads", "kv"), **kw,
        )  # fmt: skip
        self.c_proj = nnx.Einsum(
            "btnh,nhc->btc", (N, H, n_embd), (n_embd,),
            kernel_init=logical(_normal(proj_std), "heads", "kv", "embed"),
            bias_init=logical(_zeros, "embed"), **kw,
        )  # fmt: skip

    def __call__(self, x, positions=None, segments=None, cache=None):  # (B, T, C); see GPT2.hidden_states
        qkv = kept(self.c_attn(x), "attention_projection")  # (B, T, 3, N, H); kept: for --remat dots-except-mlp-in
        q, k, v = (constrain(qkv[:, :, i], "batch", "length", "heads", "kv") for i in range(3))  # each (B, T, N, H)
        if cache is not None:  # decoding: positions (B, T) index the cache (nnxscale.layers.kv_cache)
            k, v, cache = kv_cache.write(cache, k, v, positions)
            y = constrain(kv_cache.attend(q, k, v, positions, impl=self.impl), "batch", "length", "heads", "kv")
            return self.c_proj(y), cache
        y = attend(q, k, v, causal=True, q_positions=positions, k_positions=positions, q_segments=segments,
                   k_segments=segments, impl=self.impl)  # fmt: skip  (B, T, N, H)
        y = constrain(y, "batch", "length", "heads", "kv")
        return kept(self.c_proj(y), "attention_output")  # (B, T, C)


class MLP(nnx.Module):
    def __init__(self, n_embd: int, *, proj_std: float, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.c_fc = nnx.Linear(
            n_embd, 4 * n_embd, kernel_init=logical(_normal(0.02), "embed", "mlp"),
            bias_init=logical(_zeros, "mlp"), **kw,
        )  # fmt: skip
        self.c_proj = nnx.Linear(
            4 * n_embd, n_embd, kernel_init=logical(_normal(proj_std), "mlp", "embed"),
            bias_init=logical(_zeros, "embed"), **kw,
        )  # fmt: skip

    def __call__(self, x):  # (B, T, C)
        h = constrain(self.c_fc(x), "batch", "length", "mlp")  # (B, T, 4C)
        return kept(self.c_proj(jax.nn.gelu(h, approximate=True)), "mlp_output")  # tanh GELU = HF gelu_new


class Block(nnx.Module):
    def __init__(self, n_embd, n_head, *, proj_std, eps, dropout, attention="auto", dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.ln_1 = _layer_norm(n_embd, eps, **kw)
        self.attn = CausalSelfAttention(n_embd, n_head, proj_std=proj_std, impl=attention, **kw)
        self.ln_2 = _layer_norm(n_embd, eps, **kw)
        self.mlp = MLP(n_embd, proj_std=proj_std, **kw)
        self.dropout = dropout

    def __call__(self, x, positions=None, segments=None, key=None, cache=None):  # (B, T, C)
        if cache is not None:  # decoding (no dropout): returns (x, cache)
            x = constrain(x, "batch", "length", "embed")
            a, cache = self.attn(self.ln_1(x), positions, cache=cache)
            x = x + a
            return constrain(x + self.mlp(self.ln_2(x)), "batch", "length", "embed"), cache
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        x = constrain(x, "batch", "length", "embed")  # the residual stream
        with lora.dropout_key(key):  # LoRA adapters' dropout, when they have one
            x = x + dropout(self.attn(self.ln_1(x), positions, segments), self.dropout, k1)
            x = x + dropout(self.mlp(self.ln_2(x)), self.dropout, k2)
        return constrain(x, "batch", "length", "embed")


class GPT2(nnx.Module):
    """GPT-2 language model with the output head tied to the token embedding.

    The state is parameters only (no RNG state): dropout randomness comes from the
    ``rngs`` argument of each call.
    """

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        c = self.config = config
        kw = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype), rngs=rngs)
        self.wte = nnx.Embed(c.vocab_size, c.n_embd, embedding_init=logical(_normal(0.02), "vocab", "embed"), **kw)
        self.wpe = nnx.Embed(c.n_positions, c.n_embd, embedding_init=logical(_normal(0.02), None, "embed"), **kw)
        proj_std = 0.02 / math.sqrt(2 * c.n_layer)  # GPT-2 paper: scale residual projections by 1/sqrt(N)
        block = partial(Block, c.n_embd, c.n_head, proj_std=proj_std, eps=c.layer_norm_epsilon, dropout=c.dropout,
                        attention=c.attention)  # fmt: skip
        self.h = stack_layers(lambda rngs: block(**(kw | {"rngs": rngs})), c.n_layer, rngs=rngs)
        self.ln_f = _layer_norm(c.n_embd, c.layer_norm_epsilon, **kw)

    def __call__(self, tokens, *, rngs: Optional[nnx.Rngs] = None):
        """``tokens`` int (B, T) -> float32 logits (B, T, vocab_size).

        Dropout (embeddings and residual branches; never the attention probabilities) is
        applied only when ``rngs`` is given and ``config.dropout > 0``; its key comes from
        the ``dropout`` stream (or ``default``).
        """
        return self.logits(self.hidden_states(tokens, rngs=rngs))

    def hidden_states(self, tokens, *, rngs: Optional[nnx.Rngs] = None, positions=None, segments=None, cache=None):
        """``tokens`` int (B, T) -> the final layer norm's output (B, T, n_embd), before the head.

        ``positions`` (T,) or (B, T) ints: each token's place in its sequence (default
        ``0..T-1``): given when ``tokens`` are stored out of order (a zigzag layout over a
        ``context`` axis) or hold several documents, each starting at 0.
        ``segments`` (B, T) ints: document ids; a token attends only within its document.
        ``cache``: decoding (no dropout): a cache from :meth:`init_cache`, ``positions``
        ``(B, T)`` contiguous in each row; returns ``(hidden states, updated cache)``.
        """
        c = self.config
        T = tokens.shape[1]
        if T > c.n_positions:
            raise ModelError(f"sequence length {T} exceeds the context n_positions={c.n_positions}")
        if cache is not None:
            x = constrain(self.wte(tokens) + self.wpe(positions), "batch", "length", "embed")
            x, cache = scan_layers(self.h, x, positions, cache=cache)
            return self.ln_f(x), cache
        embed_key, block_keys = dropout_keys(rngs, max(c.dropout, lora.dropout_rate(self)), c.n_layer)
        x = self.wte(tokens) + self.wpe(jnp.arange(T) if positions is None else positions)  # (B, T, C)
        x = dropout(constrain(x, "batch", "length", "embed"), c.dropout, embed_key)
        x = scan_layers(self.h, x, *layer_args(positions, segments), keys=block_keys, remat=c.remat)  # (B, T, C)
        return self.ln_f(x)

    def init_cache(self, batch: int, length: int) -> dict:
        """An empty decoding cache for ``batch`` rows of up to ``length`` positions (at most
        ``n_positions``), laid out by the activation rules in force."""
        c = self.config
        return kv_cache.empty(c.n_layer, batch, length, c.n_head, c.n_embd // c.n_head, jnp.dtype(c.dtype), "heads")

    def head(self):
        """The output head's weight (n_embd, vocab_size), in the parameters' dtype: the token
        embedding's transpose (tied)."""
        return self.wte.embedding[...].T

    def logits(self, x):
        """The output head, tied to the token embedding: (B, T, C) -> float32 logits (B, T, V)."""
        logits = jnp.einsum("btc,cv->btv", x, self.head().astype(x.dtype), preferred_element_type=jnp.float32)
        return constrain(logits, "batch", "length", "vocab")  # (B, T, V)
