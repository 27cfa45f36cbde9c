"""Write the small Hugging Face GPT-2 checkpoint the test suite checks against.

Run by hand, once, with PyTorch and transformers kept out of the project's environment::

    python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch transformers safetensors numpy
    python3 tools/make_gpt2_fixture.py --hf-python /tmp/refvenv/bin/python

Hugging Face's own ``GPT2LMHeadModel`` builds a random model (the output head tied to the
token embedding, as GPT-2 has it; every weight, bias and layer-norm parameter perturbed so
a wrong mapping shows) and writes it with ``save_pretrained`` to
``tests/data/hf_gpt2/model`` (its ``config.json`` as transformers writes it, and
``model.safetensors``), then computes its float32 logits, in eval mode, for
``tests/data/hf_gpt2/tokens.npy`` into ``tests/data/hf_gpt2/hf_logits.npy``.
``tests/test_gpt2_hf.py`` loads that directory with nnxscale and compares logits: an
independent reference in CI, with nothing downloaded and no torch installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "tests" / "data" / "hf_gpt2"
# transformers' GPT2Config defaults otherwise: gelu_new, layer_norm_epsilon 1e-5, dropouts 0.1
# (off in eval mode), tie_word_embeddings True; the end-of-text token is the last of this vocabulary.
CONFIG = dict(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=95, eos_token_id=95)
TOKENS_SHAPE = (2, 16)


def hf_side(out: str, config_json: str) -> None:
    """Runs in the reference environment: torch and transformers, no nnxscale."""
    import torch
    import transformers

    out = Path(out)
    config = transformers.GPT2Config(**json.loads(config_json), attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    scales = ("ln_1.weight", "ln_2.weight", "ln_f.weight")
    with torch.no_grad():  # every weight random, layer-norm scales near 1, so a wrong mapping shows
        for name, p in model.named_parameters():  # the tied lm_head.weight is wte.weight, listed once
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith(scales) else 0.05 * torch.randn_like(p))
    assert model.lm_head.weight is model.transformer.wte.weight, "GPT-2's head must be tied"
    model.save_pretrained(out / "model", safe_serialization=True)
    tokens = torch.tensor(np.load(out / "tokens.npy"), dtype=torch.long)
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
    np.save(out / "hf_logits.npy", logits.astype(np.float32))
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: logits {logits.shape}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-python", default="/tmp/refvenv/bin/python", help="python with torch and transformers")
    args = parser.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    tokens = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], size=TOKENS_SHAPE)
    np.save(OUT / "tokens.npy", tokens)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([args.hf_python, __file__, "--hf-side", str(OUT), json.dumps(CONFIG)], check=True, env=env)
    for path in sorted(OUT.rglob("*")):
        if path.is_file():
            print(f"{path.relative_to(OUT.parent)}: {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--hf-side":
        hf_side(*sys.argv[2:4])
    else:
        sys.exit(main())
