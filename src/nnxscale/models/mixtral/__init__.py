"""Mixtral (Jiang et al., 2024) in Flax NNX: Llama's attention with a mixture of SwiGLU
experts in place of each layer's MLP. So far its config and presets (``config``); the
modules, routing and expert parallelism are the rest of issue 17.
"""

from nnxscale.models.mixtral.config import PRESETS, MixtralConfig, preset

__all__ = ["MixtralConfig", "PRESETS", "preset"]
