"""What the model families share: reading and writing Hugging Face safetensors checkpoints
(``hf_checkpoint``), the checks every family config runs (``model_config``), and dropout
with keys folded per layer (``dropout``).
"""
