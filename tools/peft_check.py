"""Check `nnxscale export` against Hugging Face PEFT itself: the same logits.

Run by hand, in two venvs (PEFT, transformers and torch are no dependency of nnxscale):

    # 1. nnxscale's logits of a LoRA run, on fixed tokens (nnxscale's venv)
    python tools/peft_check.py nnxscale --run-dir RUN --out /tmp/check.npz
    nnxscale export --run-dir RUN --peft /tmp/peft --merged /tmp/merged
    # 2. PEFT's logits of the base with the adapter, and transformers' of the merged model
    /tmp/venv-peft/bin/python tools/peft_check.py hf --base BASE_HF_DIR --peft /tmp/peft --merged /tmp/merged \
        --logits /tmp/check.npz

The second step prints the largest absolute logit difference of each against nnxscale's.
"""

from __future__ import annotations

import argparse
import os


def nnxscale_logits(run_dir: str, out: str, batch: int, length: int, seed: int) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    import numpy as np

    import nnxscale

    model = nnxscale.load_model(run_dir)
    vocab = model.config.vocab_size
    tokens = np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)
    logits = np.asarray(model(tokens), np.float32)
    np.savez(out, tokens=tokens, logits=logits)
    print(f"{out}: nnxscale logits {logits.shape} of {run_dir}")


def hf_logits(base: str, peft_dir: str, merged: str | None, saved: str) -> None:
    import numpy as np
    import peft
    import torch
    import transformers

    data = np.load(saved)
    tokens, want = torch.tensor(data["tokens"], dtype=torch.long), data["logits"]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")
    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    with torch.no_grad():
        plain = model(tokens).logits.numpy()
        adapted = peft.PeftModel.from_pretrained(model, peft_dir).eval()
        got = adapted(tokens).logits.numpy()
    print(f"base without the adapter: max |logit difference| {np.abs(plain - want).max():.3e} (the adapter matters)")
    print(f"PEFT (base + {peft_dir}): max |logit difference| {np.abs(got - want).max():.3e}")
    if merged:
        m = transformers.AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32)
        with torch.no_grad():
            got = m(tokens).logits.numpy()
        print(f"merged ({merged}): max |logit difference| {np.abs(got - want).max():.3e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="side", required=True)
    a = sub.add_parser("nnxscale")
    a.add_argument("--run-dir", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--batch", type=int, default=2)
    a.add_argument("--length", type=int, default=16)
    a.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("hf")
    b.add_argument("--base", required=True)
    b.add_argument("--peft", required=True)
    b.add_argument("--merged")
    b.add_argument("--logits", required=True)
    args = p.parse_args()
    if args.side == "nnxscale":
        nnxscale_logits(args.run_dir, args.out, args.batch, args.length, args.seed)
    else:
        hf_logits(args.base, args.peft, args.merged, args.logits)


if __name__ == "__main__":
    main()
