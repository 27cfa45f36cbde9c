"""Attention implementations by name, without jax (the CLI and configs read them first).

The implementations behind the names are :func:`nnxscale.layers.attention.attention`'s.
"""

IMPLEMENTATIONS = ("auto", "xla", "blockwise", "cudnn", "splash", "pallas-gpu")
