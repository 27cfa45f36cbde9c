"""Mixtral (Jiang et al., 2024) in Flax NNX: Llama's attention with a mixture of SwiGLU
experts in place of each layer's MLP (:mod:`nnxscale.layers.moe`: top-k routing, dropless,
grouped matmuls). Module and parameter names follow Hugging Face's ``MixtralForCausalLM``
(``layers.block_sparse_moe.gate`` is the router; the experts' ``w1``, ``w3``, ``w2`` are held
stacked, ``(experts, ...)``).

``config`` holds the config and presets, ``model`` the modules, ``hf`` the Hugging Face
import and export.
"""

from nnxscale.models.mixtral.config import PRESETS, MixtralConfig, preset
from nnxscale.models.mixtral.hf import from_pretrained, pretrained_config, save_pretrained
from nnxscale.models.mixtral.model import Mixtral, MixtralDecoderLayer

__all__ = ["Mixtral", "MixtralConfig", "MixtralDecoderLayer", "PRESETS", "from_pretrained", "preset",
           "pretrained_config", "save_pretrained"]
