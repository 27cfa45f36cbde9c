"""Independent numpy reference of Hugging Face's GPT2LMHeadModel forward (test helper).

Written from the HF checkpoint layout, not from nnxscale: it reads the safetensors
tensors by their HF names, applies Conv1D as ``x @ W + b`` with ``W`` of shape
``(in, out)``, splits the fused qkv projection the way HF's ``GPT2Attention`` does, and
computes everything in float64.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def load(path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(config.json as a dict, {unprefixed name: float64 array})`` of an HF GPT-2 directory."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    params = {k.removeprefix("transformer."): np.asarray(v, np.float64) for k, v in tensors.items()}
    return config, params


def layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def gelu_new(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def conv1d(x, params, name):
    return x @ params[name + ".weight"] + params[name + ".bias"]


def attention(x, params, prefix, n_head):
    B, T, C = x.shape
    hd = C // n_head
    qkv = conv1d(x, params, prefix + "c_attn")  # (B, T, 3C)
    q, k, v = np.split(qkv, 3, axis=-1)
    q, k, v = (t.reshape(B, T, n_head, hd).transpose(0, 2, 1, 3) for t in (q, k, v))  # (B, nh, T, hd)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)  # (B, nh, T, T)
    causal = np.tril(np.ones((T, T), dtype=bool))
    scores = np.where(causal, scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    probs = probs / probs.sum(-1, keepdims=True)
    y = (probs @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    return conv1d(y, params, prefix + "c_proj")


def logits(config: dict, params: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """float64 logits (B, T, vocab) of GPT2LMHeadModel in eval mode (no dropout)."""
    eps = config["layer_norm_epsilon"]
    T = tokens.shape[1]
    x = params["wte.weight"][tokens] + params["wpe.weight"][np.arange(T)]
    for i in range(config["n_layer"]):
        p = f"h.{i}."
        a = layer_norm(x, params[p + "ln_1.weight"], params[p + "ln_1.bias"], eps)
        x = x + attention(a, params, p + "attn.", config["n_head"])
        m = layer_norm(x, params[p + "ln_2.weight"], params[p + "ln_2.bias"], eps)
        x = x + conv1d(gelu_new(conv1d(m, params, p + "mlp.c_fc")), params, p + "mlp.c_proj")
    x = layer_norm(x, params["ln_f.weight"], params["ln_f.bias"], eps)
    return x @ params["wte.weight"].T
