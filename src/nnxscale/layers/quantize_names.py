"""The schemes of ``--quantize-base`` by name, without jax (the CLI and configs read them
first); the quantization itself is :mod:`nnxscale.layers.quantize`."""

#: ``nf4``: 4-bit NormalFloat codes (QLoRA's); ``int8``: 8-bit integer codes. Each in blocks of
#: 64 entries with a float32 scale per block.
SCHEMES = ("nf4", "int8")
