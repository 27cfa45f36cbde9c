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

``config`` holds the config and presets, ``model`` the modules, ``hf`` the Hugging Face
import and export.
"""

from nnxscale.models.gpt2.config import GPT2Config, PRESETS, preset
from nnxscale.models.gpt2.model import Block, CausalSelfAttention, GPT2, MLP
from nnxscale.models.gpt2.hf import from_pretrained, pretrained_config, save_pretrained

__all__ = ['Block', 'CausalSelfAttention', 'GPT2', 'GPT2Config', 'MLP', 'PRESETS', 'from_pretrained', 'preset', 'pretrained_config', 'save_pretrained']
