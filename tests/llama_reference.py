"""Independent numpy reference of Hugging Face's LlamaForCausalLM forward (test helper).

Written from the HF checkpoint layout and HF's modeling code, not from nnxscale: it reads
the safetensors tensors by their HF names (one file or a sharded index), applies Linear
as ``x @ W.T`` with ``W`` of shape ``(out, in)``, rotates q and k with ``rotate_half``,
repeats each K/V head for its group of query heads as ``repeat_kv`` does, computes
Llama 3's scaled frequencies as ``_compute_llama3_parameters`` does, and works in float64.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def load(path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(config.json as a dict, {HF name: float64 array})`` of an HF Llama directory."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    params = {}
    for file in files:
        params |= {k: np.asarray(v, np.float64) for k, v in load_file(str(path / file)).items()}
    return config, params


def inv_frequencies(config: dict) -> np.ndarray:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    inv_freq = 1.0 / (config["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    scaling = config.get("rope_scaling")
    if not scaling:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama)


def rms_norm(x, w, eps):
    return w * (x / np.sqrt((x**2).mean(-1, keepdims=True) + eps))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return np.concatenate([-x2, x1], axis=-1)


def attention(x, params, prefix, config, cos, sin):
    B, T, _ = x.shape
    N, K = config["num_attention_heads"], config["num_key_value_heads"]

    def heads(name, n):  # (B, n, T, head_dim)
        y = x @ params[prefix + name + ".weight"].T
        return y.reshape(B, T, n, -1).transpose(0, 2, 1, 3)

    q, k, v = heads("q_proj", N), heads("k_proj", K), heads("v_proj", K)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)  # repeat_kv
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])  # (B, N, T, T)
    scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    y = (probs @ v).transpose(0, 2, 1, 3).reshape(B, T, -1)
    return y @ params[prefix + "o_proj.weight"].T


def mlp(x, params, prefix):
    gate = x @ params[prefix + "gate_proj.weight"].T
    up = x @ params[prefix + "up_proj.weight"].T
    return (gate / (1.0 + np.exp(-gate)) * up) @ params[prefix + "down_proj.weight"].T


def logits(config: dict, params: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """float64 logits (B, T, vocab) of LlamaForCausalLM in eval mode."""
    eps = config["rms_norm_eps"]
    T = tokens.shape[1]
    freqs = np.arange(T, dtype=np.float64)[:, None] * inv_frequencies(config)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)  # (T, head_dim)
    cos, sin = np.cos(emb), np.sin(emb)
    x = params["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = x + attention(rms_norm(x, params[p + "input_layernorm.weight"], eps), params, p + "self_attn.", config, cos, sin)
        x = x + mlp(rms_norm(x, params[p + "post_attention_layernorm.weight"], eps), params, p + "mlp.")
    x = rms_norm(x, params["model.norm.weight"], eps)
    head = params["model.embed_tokens.weight"] if config["tie_word_embeddings"] else params["lm_head.weight"]
    return x @ head.T
