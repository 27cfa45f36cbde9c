"""Write the small Hugging Face Mixtral checkpoint the test suite checks against.

Run by hand, once, with PyTorch and transformers kept out of the project's environment::

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch transformers safetensors numpy
    python3 tools/make_mixtral_fixture.py --hf-python /tmp/refvenv/bin/python

Hugging Face's own ``MixtralForCausalLM`` builds a random model (8 experts, top 2, grouped-
query attention, a separate head) and writes it with ``save_pretrained`` to
``tests/data/hf_mixtral/model``, then computes its float32 logits for
``tests/data/hf_mixtral/tokens.npy`` into ``hf_logits.npy``. ``tests/test_mixtral.py`` loads
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
OUT = HERE.parent / "tests" / "data" / "hf_mixtral"
CONFIG = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
    num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None,
    router_jitter_noise=0.0,
)  # fmt: skip


def hf_side(directory: str, config_json: str) -> None:
    """Runs in the reference environment: torch and transformers, no nnxscale."""
    import torch
    import transformers

    directory = Path(directory)
    tokens = torch.tensor(np.load(directory.parent / "tokens.npy"), dtype=torch.long)
    config = transformers.MixtralConfig(**json.loads(config_json), attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # every weight random, norms near 1, so a wrong mapping shows
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
        logits = model(tokens).logits.float().numpy()
    model.save_pretrained(directory, safe_serialization=True)
    np.save(directory / "hf_logits.npy", logits)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-python", default="/tmp/refvenv/bin/python", help="python with torch and transformers")
    parser.add_argument("--hf-side", nargs=2, metavar=("DIR", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_side:
        hf_side(*args.hf_side)
        return 0
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    np.save(OUT / "tokens.npy", np.random.default_rng(0).integers(0, CONFIG["vocab_size"], size=(2, 24)))
    subprocess.run([args.hf_python, __file__, "--hf-side", str(OUT / "model"), json.dumps(CONFIG)], check=True)
    for path in sorted(OUT.rglob("*")):
        print(f"{path.relative_to(OUT.parent)}: {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
