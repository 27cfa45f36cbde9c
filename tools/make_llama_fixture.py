"""Write the small Hugging Face Llama checkpoint the test suite checks against.

Run by hand, once, with PyTorch and transformers kept out of the project's environment::

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch transformers safetensors numpy
    python3 tools/make_llama_fixture.py --hf-python /tmp/refvenv/bin/python

Hugging Face's own ``LlamaForCausalLM`` builds a random model (grouped-query attention,
Llama 3 rope scaling with all three frequency bands in use, a separate head) and writes it
with ``save_pretrained`` to ``tests/data/hf_llama/model`` (its ``config.json`` as
transformers writes it, and ``model.safetensors``), then computes its float32 logits for
``tests/data/hf_llama/tokens.npy`` into ``hf_logits.npy``. ``tests/test_llama.py`` loads
that directory with nnxscale and compares logits: an independent reference in CI, with
nothing downloaded and no torch installed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "tests" / "data" / "hf_llama"
CONFIG = dict(
    vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
    tie_word_embeddings=False, max_shard_size="5GB",
)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-python", default="/tmp/refvenv/bin/python", help="python with torch and transformers")
    args = parser.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], size=(2, 24))
    np.save(OUT / "tokens.npy", tokens)
    cmd = [args.hf_python, str(HERE / "llama_hf_check.py"), "--hf-side", "make", str(OUT / "model"), json.dumps(CONFIG)]
    subprocess.run(cmd, check=True)
    for path in sorted(OUT.rglob("*")):
        print(f"{path.relative_to(OUT.parent)}: {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
