"""GPT-2 (Radford et al., 2019) in Flax NNX, written for one device.

Module and parameter names follow the Hugging Face checkpoint (``wte``, ``h.attn.c_attn``,
``ln_f``), so :func:`from_pretrained` loads weights by name. Every parameter carries
logical axis names only (``"vocab"``, ``"embed"``, ``"heads"``, ``"kv"``, ``"mlp"``), and
activations are constrained by logical name at block boundaries (``"batch"``,
``"length"``, ...); rules map both to mesh axes elsewhere (:func:`nnxscale.resolve`).

The blocks are stacked (:func:`nnxscale.stack_layers`): ``h`` holds every block's
parameters with a leading ``layers`` axis, and :func:`nnxscale.scan_layers` runs them, so
the step compiles one block whatever the depth and ``remat`` policies work. Hugging Face
checkpoints keep one tensor per block (``h.0.attn.c_attn.weight``); import and export
stack and unstack them.

Departures from the published model, all deliberate:

- Attention runs through ``jax.nn.dot_product_attention``, which has no dropout on the
  attention probabilities; dropout applies to the embeddings and the two residual
  branches of every block only (``attn_pdrop`` is written as 0.0 on save).
- The fused qkv projection keeps heads as their own axis, ``(embed, 3, heads, head_dim)``,
  so tensor parallelism can split it by head; HF's ``(embed, 3*embed)`` is a reshape of it.
"""

from __future__ import annotations

import dataclasses
import json
import math
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

_normal = nnx.initializers.normal
_zeros = nnx.initializers.zeros_init()
_ones = nnx.initializers.ones_init()


# --------------------------------------------------------------------------------------
# Config and presets
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPT2Config(ModelConfig):
    """GPT-2 hyperparameters.

    ``dtype`` is the compute dtype (parameters are cast at use; logits are always
    float32), ``param_dtype`` the storage dtype of the parameters. ``dropout`` applies to
    embeddings and residual branches, and only when ``GPT2.__call__`` gets ``rngs``.
    ``remat`` is a policy of :data:`nnxscale.layers.stack.REMAT_POLICIES` (``"none"``,
    ``"full"``: keep each block's input only, ``"dots"``: keep the weight matmuls'
    outputs); ``True`` means ``"full"``.
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


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


def _layer_norm(n_embd, eps, dtype, param_dtype, rngs):
    return nnx.LayerNorm(
        n_embd, epsilon=eps, use_fast_variance=False, dtype=dtype, param_dtype=param_dtype,
        scale_init=logical(_ones, "embed"), bias_init=logical(_zeros, "embed"), rngs=rngs,
    )  # fmt: skip


class CausalSelfAttention(nnx.Module):
    def __init__(self, n_embd: int, n_head: int, *, proj_std: float, dtype, param_dtype, rngs: nnx.Rngs):
        N, H = n_head, n_embd // n_head
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

    def __call__(self, x):  # (B, T, C)
        qkv = self.c_attn(x)  # (B, T, 3, N, H)
        q, k, v = (constrain(qkv[:, :, i], "batch", "length", "heads", "kv") for i in range(3))  # each (B, T, N, H)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # (B, T, N, H)
        y = constrain(y, "batch", "length", "heads", "kv")
        return self.c_proj(y)  # (B, T, C)


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
        return self.c_proj(jax.nn.gelu(h, approximate=True))  # tanh GELU = HF gelu_new


class Block(nnx.Module):
    def __init__(self, n_embd, n_head, *, proj_std, eps, dropout, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.ln_1 = _layer_norm(n_embd, eps, **kw)
        self.attn = CausalSelfAttention(n_embd, n_head, proj_std=proj_std, **kw)
        self.ln_2 = _layer_norm(n_embd, eps, **kw)
        self.mlp = MLP(n_embd, proj_std=proj_std, **kw)
        self.dropout = dropout

    def __call__(self, x, key=None):  # (B, T, C)
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        x = constrain(x, "batch", "length", "embed")  # the residual stream
        x = x + dropout(self.attn(self.ln_1(x)), self.dropout, k1)
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
        block = partial(Block, c.n_embd, c.n_head, proj_std=proj_std, eps=c.layer_norm_epsilon, dropout=c.dropout)
        self.h = stack_layers(lambda rngs: block(**(kw | {"rngs": rngs})), c.n_layer, rngs=rngs)
        self.ln_f = _layer_norm(c.n_embd, c.layer_norm_epsilon, **kw)

    def __call__(self, tokens, *, rngs: Optional[nnx.Rngs] = None):
        """``tokens`` int (B, T) -> float32 logits (B, T, vocab_size).

        Dropout (embeddings and residual branches; never the attention probabilities) is
        applied only when ``rngs`` is given and ``config.dropout > 0``; its key comes from
        the ``dropout`` stream (or ``default``).
        """
        c = self.config
        T = tokens.shape[1]
        if T > c.n_positions:
            raise ModelError(f"sequence length {T} exceeds the context n_positions={c.n_positions}")
        embed_key, block_keys = dropout_keys(rngs, c.dropout, c.n_layer)
        x = self.wte(tokens) + self.wpe(jnp.arange(T))  # (B, T, C)
        x = dropout(constrain(x, "batch", "length", "embed"), c.dropout, embed_key)
        x = scan_layers(self.h, x, keys=block_keys, remat=c.remat)  # (B, T, C)
        x = self.ln_f(x)
        wte = self.wte.embedding[...].astype(x.dtype)  # (V, C)
        logits = jnp.einsum("btc,vc->btv", x, wte, preferred_element_type=jnp.float32)  # (B, T, V)
        return constrain(logits, "batch", "length", "vocab")


# --------------------------------------------------------------------------------------
# Hugging Face checkpoints (safetensors)
# --------------------------------------------------------------------------------------

_LEAF_NAMES = {"embedding": "weight", "kernel": "weight", "scale": "weight", "bias": "bias"}
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # HF causal-mask buffers, not parameters


def _hf_param(path, shape: tuple[int, ...]) -> HFParam:
    """HF tensor names of one parameter, and how their Conv1D layout relates to ours.

    ``('wte', 'embedding')`` -> ``wte.weight``; the stacked ``('h', 'attn', 'c_attn',
    'kernel')`` of shape ``(L, C, 3, N, H)`` -> ``h.0.attn.c_attn.weight`` ...
    ``h.{L-1}...``, each ``(C, 3*N*H)``: heads are separate axes here, a reshape there.
    """
    parts = [key_part(k) for k in path]
    stacked = parts[0] == "h"
    name = ".".join(parts[1 if stacked else 0 : -1] + [_LEAF_NAMES[parts[-1]]])
    keys = tuple(f"h.{i}.{name}" for i in range(shape[0])) if stacked else (name,)
    s = shape[1:] if stacked else shape
    if name.endswith("attn.c_attn.weight"):  # (C, 3, N, H) <- (C, 3C)
        layout = HFLayout(((s[0],), tuple(s[1:])), tuple(range(len(s))))
    elif name.endswith("attn.c_attn.bias"):  # (3, N, H) <- (3C,)
        layout = HFLayout((tuple(s),), tuple(range(len(s))))
    elif name.endswith("attn.c_proj.weight"):  # (N, H, C) <- (C, C)
        layout = HFLayout((tuple(s[:-1]), (s[-1],)), tuple(range(len(s))))
    else:
        layout = HFLayout.same(s)
    return HFParam(keys, layout, stacked)


def _hf_config(config: GPT2Config) -> dict[str, Any]:
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size,
        "n_positions": config.n_positions,
        "n_ctx": config.n_positions,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "activation_function": "gelu_new",
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": 0.0,  # not applied here (see the module docstring)
        "initializer_range": 0.02,
    }


def _config_from_hf(hf: dict[str, Any], param_dtype: str, dtype: Optional[str], where: Path) -> GPT2Config:
    missing = [k for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head") if k not in hf]
    if missing:
        raise ModelError(f"{where} lacks the GPT-2 fields {missing}")
    unsupported = {
        "activation_function": (hf.get("activation_function", "gelu_new"), ("gelu_new", "gelu_pytorch_tanh")),
        "n_inner": (hf.get("n_inner"), (None, 4 * hf["n_embd"])),
        "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), (False,)),
        "tie_word_embeddings": (hf.get("tie_word_embeddings", True), (True,)),
    }
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ModelError(f"{where}: {name}={value!r} is not supported by this GPT-2 (supported: {allowed})")
    return GPT2Config(
        vocab_size=hf["vocab_size"], n_positions=hf["n_positions"], n_embd=hf["n_embd"],
        n_layer=hf["n_layer"], n_head=hf["n_head"], dropout=float(hf.get("resid_pdrop", 0.0)),
        layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        dtype=dtype or "float32", param_dtype=param_dtype,
    )  # fmt: skip


def pretrained_config(path) -> GPT2Config:
    """The architecture of an HF GPT-2 directory, from its ``config.json`` alone (no weights read),
    with float32 parameters and the default run options: what ``--model DIR`` trains."""
    path = Path(path)
    return _config_from_hf(read_config(path, "GPT-2"), "float32", None, path / "config.json")


def save_pretrained(model: GPT2, path) -> None:
    """Write ``path/config.json`` and ``path/model.safetensors`` in the HF GPT-2 layout.

    Keys are unprefixed as in the official checkpoint (``wte.weight``, ``h.0.attn.c_attn.weight``):
    the stacked blocks are written one tensor per block; the tied head is not written.
    Tensors keep the parameter dtype.
    """
    path = Path(path)
    save_safetensors(hf_tensors(model, _hf_param), path, max_shard_bytes=None)
    (path / "config.json").write_text(json.dumps(_hf_config(model.config), indent=2) + "\n")


def from_pretrained(path, *, mesh=None, rules=None, dtype: Optional[str] = None) -> GPT2:
    """Load an HF GPT-2 directory (``config.json`` + ``model.safetensors``) into a :class:`GPT2`.

    Keys may be unprefixed or start with ``transformer.``; ``lm_head.weight`` (tied: must
    equal ``wte.weight``) and the ``attn.bias``/``attn.masked_bias`` buffers are ignored.
    Parameters keep the checkpoint's dtype when it is float32 or bfloat16 (otherwise they
    become float32); ``dtype`` sets the compute dtype (``GPT2Config.dtype``, default float32).

    With ``mesh``, every array is created directly in the layout ``rules`` give on it:
    each device reads only its own slice from the file, no device holds a full tensor.
    """
    path = Path(path)
    hf, cfg_file = read_config(path, "GPT-2"), path / "config.json"

    with SafetensorsFiles(path) as files:
        names = {}  # unprefixed name -> key in the file
        for key in files.keys():
            name = key.removeprefix("transformer.")
            if not name.endswith(_IGNORED_SUFFIXES):
                names[name] = key
        tied = names.pop("lm_head.weight", None)
        param_dtype = files.param_dtype(names["wte.weight"]) if "wte.weight" in names else "float32"
        config = _config_from_hf(hf, param_dtype, dtype, cfg_file)
        factory = lambda: GPT2(config, rngs=nnx.Rngs(0))  # noqa: E731
        model = load_module(files, factory, _hf_param, names, mesh=mesh, rules=rules, model_name="GPT-2")
        if tied is not None and not np.array_equal(files.tensor(tied), files.tensor(names["wte.weight"])):
            raise ModelError(f"{files.where}: {tied!r} differs from the token embedding, but GPT-2 ties them")
    return model
