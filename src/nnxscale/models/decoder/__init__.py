"""One decoder for every supported architecture (Llama, Mixtral, Mistral, Qwen2/3, Qwen3-MoE,
Gemma 2/3, DeepSeek-V2/V3): :class:`Decoder` built from a :class:`DecoderConfig` whose fields
are the switches those architectures set. A family is a translation of its Hugging Face
``config.json`` into these fields, its names and its presets (``docs/models.md``).
"""

from nnxscale.models.decoder.config import DecoderConfig, LayerKind, Segment, layer_segments
from nnxscale.models.decoder.hf import HFFamily, hf_param_of
from nnxscale.models.decoder.layers import MLP, Attention, DecoderLayer, LatentAttention, LayerGroup
from nnxscale.models.decoder.model import Decoder
from nnxscale.models.decoder.rope import LinearScaling, RopeScaling, YarnScaling, rope_frequencies

__all__ = ["Attention", "Decoder", "DecoderConfig", "DecoderLayer", "HFFamily", "LatentAttention", "LayerGroup",
           "LayerKind", "LinearScaling", "MLP", "RopeScaling", "Segment", "YarnScaling", "hf_param_of",
           "layer_segments", "rope_frequencies"]  # fmt: skip
