"""Host memory while a QLoRA run loads its base: ``--quantize-base nf4`` against the same
LoRA run over the bfloat16 base (issue 50: "peak host memory about one tensor, not the model").

    python bench/qlora_load_memory.py      # about 3 minutes on 2 cores; writes 1.8 GB to a temporary directory

A Llama in Hugging Face's layout is written with random bfloat16 weights: 8B's layer width
(hidden 4,096, MLP 14,336, 32 heads, 8 KV heads) and 4 layers, 0.87 B parameters (1.75 GB),
with a byte-level vocabulary so that the linear weights are nearly all of it, as in a 70B
model. Each run is ``nnxscale train --model DIR --lora-rank 16 --dtype bfloat16 --steps 1`` on
one CPU device (XLA:CPU's devices are host memory, so the process's memory holds the devices'
share too), batch 1 x 64, in a child process that polls its own anonymous resident memory
(``RssAnon`` in ``/proc/self/status``, Linux; the safetensors file's pages, mapped as it is
read, are the page cache's and not counted). A third run is the process's own floor: the
same command on a 1-layer model.

Printed: each run's peak, and over the floor, the bytes the base added, beside the base's
size in bfloat16 and in NF4 and the largest single weight. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

WIDTH = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
GB = 1e9


def write_llama(path: Path, layers: int) -> dict:
    """A random bfloat16 Llama of ``layers`` layers at 8B's width, in Hugging Face's layout."""
    from safetensors.numpy import save_file

    from nnxscale.models.llama import hf, preset

    config = preset("llama-tiny", vocab_size=256, num_hidden_layers=layers, tie_word_embeddings=False, **WIDTH)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**hf.hf_config(config), "torch_dtype": "bfloat16"}))
    C, F, H = WIDTH["hidden_size"], WIDTH["intermediate_size"], WIDTH["head_dim"]
    N, K = WIDTH["num_attention_heads"], WIDTH["num_key_value_heads"]
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (256, C), "model.norm.weight": (C,), "lm_head.weight": (256, C)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (N * H, C), p + "self_attn.k_proj.weight": (K * H, C),
                       p + "self_attn.v_proj.weight": (K * H, C), p + "self_attn.o_proj.weight": (C, N * H),
                       p + "mlp.gate_proj.weight": (F, C), p + "mlp.up_proj.weight": (F, C), p + "mlp.down_proj.weight": (C, F),
                       p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,)})  # fmt: skip
    tensors = {k: (rng.standard_normal(s, np.float32) * (0.02 if len(s) == 2 else 1.0)).astype(ml_dtypes.bfloat16)
               for k, s in shapes.items()}  # fmt: skip
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    linear = [int(np.prod(s)) for k, s in shapes.items() if "_proj" in k]
    return {"parameters": sum(int(np.prod(s)) for s in shapes.values()), "linear": sum(linear), "largest": max(linear)}


def peak_rss(model: Path, tokens: Path, run_dir: Path, *extra: str) -> float:
    """Peak anonymous resident bytes (``RssAnon``, polled every 5 ms: the safetensors file's
    mapped pages are not counted, the devices' buffers are) of one ``nnxscale train`` run in a
    child process."""
    argv = ["train", "--model", str(model), "--data", str(tokens), "--lora-rank", "16", "--dtype", "bfloat16",
            "--steps", "1", "--batch-size", "1", "--seq-len", "64", "--cpu-devices", "1", "--mesh", "data=1",
            "--eval-every", "0", "--run-dir", str(run_dir), *extra]  # fmt: skip
    code = ("import sys, threading, time\n"
            "peak = [0]\n"
            "def poll():\n"
            "    while True:\n"
            "        for line in open('/proc/self/status'):\n"
            "            if line.startswith('RssAnon:'):\n"
            "                peak[0] = max(peak[0], int(line.split()[1]) * 1024)\n"
            "        time.sleep(0.005)\n"
            "threading.Thread(target=poll, daemon=True).start()\n"
            "from nnxscale.cli.commands import main\n"
            f"code = main({argv!r})\n"
            "time.sleep(0.05)\n"
            "print(peak[0])\n"
            "sys.exit(code)\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"nnxscale {' '.join(argv)} failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokens = tmp / "tokens.npy"
        np.save(tokens, np.random.default_rng(1).integers(0, 256, 1 << 16).astype(np.uint16))
        sizes = write_llama(tmp / "llama", 4)
        write_llama(tmp / "floor", 1)
        rows = {}
        for name, model, extra in (("floor: 1 layer, nf4", tmp / "floor", ("--quantize-base", "nf4")),
                                   ("LoRA, bfloat16 base", tmp / "llama", ()),
                                   ("QLoRA, --quantize-base nf4", tmp / "llama", ("--quantize-base", "nf4"))):  # fmt: skip
            rows[name] = peak_rss(model, tokens, tmp / f"run{len(rows)}", *extra)
            print(f"{name:30} peak resident {rows[name] / GB:6.2f} GB", flush=True)
    floor = rows["floor: 1 layer, nf4"]
    bf16, nf4 = rows["LoRA, bfloat16 base"] - floor, rows["QLoRA, --quantize-base nf4"] - floor
    base_bf16, base_nf4 = sizes["linear"] * 2 * 3 / 4, sizes["linear"] * (4.5 / 8) * 3 / 4  # the 3 layers beyond the floor's 1
    print(f"over the floor: bfloat16 base {bf16 / GB:.2f} GB (its 3 more layers: {base_bf16 / GB:.2f} GB); "
          f"nf4 base {nf4 / GB:.2f} GB (their codes and scales: {base_nf4 / GB:.2f} GB; one MLP weight in bfloat16: "
          f"{sizes['largest'] * 2 / GB:.2f} GB); nf4 over bfloat16: {nf4 / bf16:.2f}")  # fmt: skip
    print(json.dumps({"peaks": rows, "sizes": sizes, "nf4_over_bf16": nf4 / bf16}))


if __name__ == "__main__":
    main()
