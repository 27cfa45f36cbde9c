"""Llama 3 (Grattafiori et al., 2024) in Flax NNX, written for one device.

RMSNorm, rotary position embeddings with Llama 3's frequency scaling, a SwiGLU MLP and
grouped-query attention (``num_key_value_heads`` K/V heads, each shared by
``num_attention_heads // num_key_value_heads`` query heads), with an optional tied head.
Module and parameter names follow Hugging Face's ``LlamaForCausalLM`` (``embed_tokens``,
``layers.self_attn.q_proj``, ``mlp.gate_proj``, ``norm``, ``lm_head``) without its
``model.`` level, so :func:`from_pretrained` loads weights by name.

Every parameter carries logical axis names only (``"vocab"``, ``"embed"``, ``"heads"``,
``"kv_heads"``, ``"kv"`` for the width of a head, ``"mlp"``) and activations are
constrained by logical name (q, k, v, the attention output, the MLP hidden, the residual
stream at block boundaries, the logits); rules map both to mesh axes elsewhere
(:func:`nnxscale.get_rules`). Tensor parallelism splits the K/V heads over the model axis when
it divides them, keeping each query head on the device of its K/V head; when it does not,
the K/V projections stay replicated and ``nnxscale.lint`` reports them ``indivisible``.
The layers are stacked and scanned as GPT-2's are (:func:`nnxscale.stack_layers`).

Departures from the published model, all deliberate:

- Dropout (``LlamaConfig.dropout``, 0 by default and in every preset) applies to the
  embeddings and the two residual branches of every layer, as GPT-2's does; Hugging Face's
  Llama has only attention dropout, which ``jax.nn.dot_product_attention`` lacks
  (``attention_dropout`` is written as 0.0 on save).
- q, k and v are separate projections with heads as their own axis, ``(embed, heads,
  head_dim)``; HF's ``(heads*head_dim, embed)`` weight is a reshape and transpose of it.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxscale.errors import ModelError
from nnxscale.layers.stack import scan_layers, stack_layers
from nnxscale.models.dropout import dropout, dropout_keys
from nnxscale.models.hf_checkpoint import (
    HFLayout,
    HFParam,
    SafetensorsFiles,
    hf_tensors,
    key_part,
    load_module,
    read_config,
    save_safetensors,
)  # fmt: skip
from nnxscale.models.model_config import ModelConfig, choose_preset
from nnxscale.sharding.activations import constrain
from nnxscale.sharding.rules import logical

_normal = nnx.initializers.normal(0.02)  # HF's initializer_range for every weight matrix
_ones = nnx.initializers.ones_init()


# --------------------------------------------------------------------------------------
# Config and presets
# --------------------------------------------------------------------------------------


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
    :data:`nnxscale.layers.stack.REMAT_POLICIES` (``True`` means ``"full"``).
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

    def __post_init__(self):
        self._check_training_fields()
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling, "LlamaConfig.rope_scaling"))
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


def _rope_scaling(d: dict, where: str) -> RopeScaling:
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


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


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
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)  # (T, 1, H)
    return x * cos + rotated * sin


def _rms_norm(hidden_size, eps, dtype, param_dtype, rngs):
    return nnx.RMSNorm(
        hidden_size, epsilon=eps, dtype=dtype, param_dtype=param_dtype, scale_init=logical(_ones, "embed"), rngs=rngs
    )


class LlamaAttention(nnx.Module):
    def __init__(self, hidden_size: int, n_heads: int, n_kv_heads: int, head_dim: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        C, N, K, H = hidden_size, n_heads, n_kv_heads, head_dim
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        proj = lambda heads, name: nnx.Einsum("btc,cnh->btnh", (C, heads, H), kernel_init=logical(_normal, "embed", name, "kv"), **kw)  # noqa: E731
        self.q_proj = proj(N, "heads")
        self.k_proj = proj(K, "kv_heads")
        self.v_proj = proj(K, "kv_heads")
        self.o_proj = nnx.Einsum("btnh,nhc->btc", (N, H, C), kernel_init=logical(_normal, "heads", "kv", "embed"), **kw)

    def __call__(self, x, cos, sin):  # x (B, T, C); cos, sin (T, H)
        q = constrain(_rotate(self.q_proj(x), cos, sin), "batch", "length", "heads", "kv")  # (B, T, N, H)
        k = constrain(_rotate(self.k_proj(x), cos, sin), "batch", "length", "kv_heads", "kv")  # (B, T, K, H)
        v = constrain(self.v_proj(x), "batch", "length", "kv_heads", "kv")  # (B, T, K, H)
        # grouped-query attention: query head n reads K/V head n // (N // K), as HF's repeat_kv
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # (B, T, N, H)
        y = constrain(y, "batch", "length", "heads", "kv")
        return self.o_proj(y)  # (B, T, C)


class LlamaMLP(nnx.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        C, F = hidden_size, intermediate_size
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(C, F, kernel_init=logical(_normal, "embed", "mlp"), **kw)
        self.up_proj = nnx.Linear(C, F, kernel_init=logical(_normal, "embed", "mlp"), **kw)
        self.down_proj = nnx.Linear(F, C, kernel_init=logical(_normal, "mlp", "embed"), **kw)

    def __call__(self, x):  # (B, T, C)
        h = constrain(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x), "batch", "length", "mlp")  # (B, T, F)
        return self.down_proj(h)  # (B, T, C)


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, c: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.input_layernorm = _rms_norm(c.hidden_size, c.rms_norm_eps, **kw)
        self.self_attn = LlamaAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_size, **kw)
        self.post_attention_layernorm = _rms_norm(c.hidden_size, c.rms_norm_eps, **kw)
        self.mlp = LlamaMLP(c.hidden_size, c.intermediate_size, **kw)
        self.dropout = c.dropout

    def __call__(self, x, cos, sin, key=None):  # x (B, T, C)
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        x = constrain(x, "batch", "length", "embed")  # the residual stream
        x = x + dropout(self.self_attn(self.input_layernorm(x), cos, sin), self.dropout, k1)
        x = x + dropout(self.mlp(self.post_attention_layernorm(x)), self.dropout, k2)
        return constrain(x, "batch", "length", "embed")


class Llama(nnx.Module):
    """Llama language model; the output head is the token embedding when
    ``config.tie_word_embeddings``, else its own ``lm_head``.

    The state is parameters only (no RNG state): dropout randomness comes from the
    ``rngs`` argument of each call.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        kw = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype), rngs=rngs)
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, embedding_init=logical(_normal, "vocab", "embed"), **kw)
        layer = partial(LlamaDecoderLayer, c)
        self.layers = stack_layers(lambda rngs: layer(**(kw | {"rngs": rngs})), c.num_hidden_layers, rngs=rngs)
        self.norm = _rms_norm(c.hidden_size, c.rms_norm_eps, **kw)
        if not c.tie_word_embeddings:
            self.lm_head = nnx.Linear(
                c.hidden_size, c.vocab_size, use_bias=False, kernel_init=logical(_normal, "embed", "vocab"), **kw
            )  # fmt: skip

    def __call__(self, tokens, *, rngs: Optional[nnx.Rngs] = None):
        """``tokens`` int (B, T) -> float32 logits (B, T, vocab_size).

        Dropout (embeddings and residual branches) is applied only when ``rngs`` is given
        and ``config.dropout > 0``; its key comes from the ``dropout`` stream (or ``default``).
        """
        c = self.config
        T = tokens.shape[1]
        if T > c.max_position_embeddings:
            raise ModelError(f"sequence length {T} exceeds the context max_position_embeddings={c.max_position_embeddings}")
        embed_key, layer_keys = dropout_keys(rngs, c.dropout, c.num_hidden_layers)
        inv_freq = rope_frequencies(c.head_size, c.rope_theta, c.rope_scaling).astype(np.float32)  # (H/2,)
        angles = jnp.arange(T, dtype=jnp.float32)[:, None] * inv_freq  # (T, H/2)
        angles = jnp.concatenate([angles, angles], axis=-1)  # (T, H): HF's rotate_half layout
        x = dropout(constrain(self.embed_tokens(tokens), "batch", "length", "embed"), c.dropout, embed_key)  # (B, T, C)
        x = scan_layers(self.layers, x, jnp.cos(angles), jnp.sin(angles), keys=layer_keys, remat=c.remat)
        x = self.norm(x)
        if c.tie_word_embeddings:
            head = self.embed_tokens.embedding[...].astype(x.dtype)  # (V, C)
            logits = jnp.einsum("btc,vc->btv", x, head, preferred_element_type=jnp.float32)
        else:
            head = self.lm_head.kernel[...].astype(x.dtype)  # (C, V)
            logits = jnp.einsum("btc,cv->btv", x, head, preferred_element_type=jnp.float32)
        return constrain(logits, "batch", "length", "vocab")  # (B, T, V)


# --------------------------------------------------------------------------------------
# Hugging Face checkpoints (safetensors)
# --------------------------------------------------------------------------------------

_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # a buffer older checkpoints carry, not a parameter


def _hf_param(path, shape: tuple[int, ...]) -> HFParam:
    """HF tensor names of one parameter and how their layout relates to ours.

    ``('layers', 'self_attn', 'q_proj', 'kernel')`` of shape ``(L, C, N, H)`` ->
    ``model.layers.{i}.self_attn.q_proj.weight``, each ``(N*H, C)``. HF's Linear weights
    are ``(out, in)``, ours ``(in, out)``.
    """
    parts = [key_part(k) for k in path]
    stacked = parts[0] == "layers"
    name = ".".join(parts[1 if stacked else 0 : -1] + ["weight"])
    if stacked:
        keys = tuple(f"model.layers.{i}.{name}" for i in range(shape[0]))
    else:
        keys = (name if name == "lm_head.weight" else f"model.{name}",)
    s, module = (shape[1:] if stacked else shape), parts[-2]
    if module in ("q_proj", "k_proj", "v_proj"):  # (C, N, H) <- (N*H, C)
        layout = HFLayout(((s[1], s[2]), (s[0],)), (2, 0, 1))
    elif module == "o_proj":  # (N, H, C) <- (C, N*H)
        layout = HFLayout(((s[2],), (s[0], s[1])), (1, 2, 0))
    elif module in ("gate_proj", "up_proj", "down_proj", "lm_head"):  # (in, out) <- (out, in)
        layout = HFLayout.transposed(s)
    else:  # embedding (V, C), RMSNorm scales (C,)
        layout = HFLayout.same(s)
    return HFParam(keys, layout, stacked)


def _hf_config(c: LlamaConfig) -> dict[str, Any]:
    scaling = None if c.rope_scaling is None else {"rope_type": "llama3", **dataclasses.asdict(c.rope_scaling)}
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,  # not applied here (see the module docstring)
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "torch_dtype": c.param_dtype,
        "use_cache": True,
    }


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings")


def _config_from_hf(hf: dict[str, Any], param_dtype: str, dtype: Optional[str], where: Path) -> LlamaConfig:
    if hf.get("model_type", "llama") != "llama":
        raise ModelError(f"{where}: model_type={hf['model_type']!r}, but this loader reads Llama checkpoints (model_type 'llama')")
    if missing := [k for k in _REQUIRED if k not in hf]:
        raise ModelError(f"{where} lacks the Llama fields {missing}")
    # Transformers 5 writes rope_parameters (with rope_theta inside); earlier ones rope_theta and rope_scaling.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported = {
        "hidden_act": (hf.get("hidden_act", "silu"), ("silu",)),
        "attention_bias": (hf.get("attention_bias", False), (False,)),
        "mlp_bias": (hf.get("mlp_bias", False), (False,)),
        "rope_type": (rope_type, ("default", "llama3")),
        "partial_rotary_factor": (rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)), (1.0,)),
    }
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ModelError(f"{where}: {name}={value!r} is not supported by this Llama (supported: {allowed})")
    N = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    return LlamaConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=N,
        num_key_value_heads=hf.get("num_key_value_heads") or N,
        max_position_embeddings=hf["max_position_embeddings"],
        head_dim=None if head_dim in (None, hf["hidden_size"] // N) else head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(rope, f"{where}: rope_scaling") if rope_type == "llama3" else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype or "float32", param_dtype=param_dtype,
    )  # fmt: skip


def pretrained_config(path) -> LlamaConfig:
    """The architecture of an HF Llama directory, from its ``config.json`` alone (no weights read),
    with float32 parameters and the default run options: what ``--model DIR`` trains."""
    path = Path(path)
    return _config_from_hf(read_config(path, "Llama"), "float32", None, path / "config.json")


def save_pretrained(model: Llama, path, *, max_shard_bytes: Optional[int] = 5 * 10**9) -> None:
    """Write ``path/config.json`` and the weights as HF's ``LlamaForCausalLM`` saves them.

    Names as in HF (``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``
    of shape (N*H, C), ..., ``lm_head.weight`` when untied), one tensor per layer, in the
    parameter dtype. One ``model.safetensors``, or, past ``max_shard_bytes`` (HF's default
    5 GB; ``None``: never), numbered files and ``model.safetensors.index.json``.
    """
    path = Path(path)
    save_safetensors(hf_tensors(model, _hf_param), path, max_shard_bytes=max_shard_bytes)
    (path / "config.json").write_text(json.dumps(_hf_config(model.config), indent=2) + "\n")


def from_pretrained(path, *, mesh=None, rules=None, dtype: Optional[str] = None) -> Llama:
    """Load an HF Llama directory (``config.json`` and ``model.safetensors`` or a sharded
    set with ``model.safetensors.index.json``) into a :class:`Llama`.

    Keys are HF's (``model.`` may be missing, as a ``LlamaModel`` saves them); a
    ``lm_head.weight`` of a tied model must equal the embedding. Parameters keep the
    checkpoint's dtype when it is float32 or bfloat16 (otherwise they become float32);
    ``dtype`` sets the compute dtype (``LlamaConfig.dtype``, default float32).

    With ``mesh``, every array is created directly in the layout ``rules`` give on it:
    each device reads only its own slice from the files, no device holds a full tensor.
    """
    path = Path(path)
    hf, cfg_file = read_config(path, "Llama"), path / "config.json"
    with SafetensorsFiles(path) as files:
        names = {}  # HF name -> key in the files
        for key in files.keys():
            if not key.endswith(_IGNORED_SUFFIXES):
                names[key if key.startswith("model.") or key == "lm_head.weight" else f"model.{key}"] = key
        embed = names.get("model.embed_tokens.weight")
        config = _config_from_hf(hf, files.param_dtype(embed) if embed else "float32", dtype, cfg_file)
        tied = names.pop("lm_head.weight", None) if config.tie_word_embeddings else None
        factory = lambda: Llama(config, rngs=nnx.Rngs(0))  # noqa: E731
        model = load_module(files, factory, _hf_param, names, mesh=mesh, rules=rules, model_name="Llama")
        if tied is not None and not np.array_equal(files.tensor(tied), files.tensor(embed)):
            raise ModelError(
                f"{files.where}: 'lm_head.weight' differs from the token embedding, but config.json says "
                "tie_word_embeddings=true; set it to false to load a separate head"
            )
    return model
