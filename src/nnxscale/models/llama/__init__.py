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

``config`` holds the config and presets, ``model`` the modules, ``hf`` the Hugging Face
import and export.
"""

from nnxscale.models.llama.config import LlamaConfig, PRESETS, RopeScaling, preset
from nnxscale.models.llama.model import Llama, LlamaAttention, LlamaDecoderLayer, LlamaMLP, rope_frequencies
from nnxscale.models.llama.hf import from_pretrained, pretrained_config, save_pretrained

__all__ = ['Llama', 'LlamaAttention', 'LlamaConfig', 'LlamaDecoderLayer', 'LlamaMLP', 'PRESETS', 'RopeScaling', 'from_pretrained', 'preset', 'pretrained_config', 'rope_frequencies', 'save_pretrained']
