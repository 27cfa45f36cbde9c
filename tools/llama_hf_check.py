"""Check nnxscale's Llama against Hugging Face's own LlamaForCausalLM, both directions.

A helper run by hand, not a test and not a dependency. Hugging Face's code runs in a
separate virtual environment (PyTorch and jax stay apart), which this script calls for
its half of the work; the nnxscale half runs in the project's environment::

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch transformers safetensors numpy   # from PyPI
    .venv/bin/python tools/llama_hf_check.py --hf-python /tmp/refvenv/bin/python

For two small random models with grouped-query attention (8 query heads on 2 K/V heads,
heads 32 wide over a 128-wide stream) and Llama 3 rope scaling whose three frequency
bands all occur, one with a separate head and one tied:

- HF -> nnxscale: HF builds a random model, ``save_pretrained`` writes safetensors (the
  tied one as a sharded set with an index), nnxscale's ``from_pretrained`` loads it (on one
  device and on a data=2,model=4 mesh); the logits of both are compared.
- nnxscale -> HF: nnxscale builds a random model, ``save_pretrained`` writes it (the tied
  one sharded), HF's ``LlamaForCausalLM.from_pretrained`` loads it reporting no missing,
  unexpected or mismatched tensors; the logits are compared.

Prints the largest absolute error and that error relative to the largest logit; exits 1
when an error exceeds ``--tolerance`` (1e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CONFIG = dict(
    vocab_size=512, hidden_size=128, intermediate_size=320, num_hidden_layers=3, num_attention_heads=8,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
)  # fmt: skip
SEQ_LEN, BATCH = 64, 4


# ---------------------------------------------------------------------- the HF half


def hf_side(command: str, directory: str, config_json: str) -> None:
    """Runs in the reference environment: torch and transformers, no nnxscale."""
    import torch
    import transformers

    kw = {"dtype": torch.float32} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": torch.float32}
    directory = Path(directory)
    tokens = torch.tensor(np.load(directory.parent / "tokens.npy"), dtype=torch.long)
    if command == "make":
        spec = json.loads(config_json)
        shard = spec.pop("max_shard_size")
        scaling = {"rope_type": "llama3", **spec.pop("rope_scaling")}
        config = transformers.LlamaConfig(**spec, rope_scaling=scaling, attn_implementation="eager")
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():  # every weight random, norms near 1, so a wrong mapping shows
            for name, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
        model.save_pretrained(directory, safe_serialization=True, max_shard_size=shard)
    else:
        model, info = transformers.LlamaForCausalLM.from_pretrained(
            directory, output_loading_info=True, attn_implementation="eager", **kw
        )
        problems = {k: v for k, v in info.items() if v}
        if problems:
            raise SystemExit(f"HF loaded {directory} with problems: {problems}")
        model.eval()
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
    np.save(directory / "hf_logits.npy", logits)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}: {command} {directory.name}", flush=True)


# ----------------------------------------------------------------- the nnxscale half


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-python", default="/tmp/refvenv/bin/python", help="python of the environment with torch and transformers")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest absolute logits error accepted")
    parser.add_argument("--keep", type=Path, help="write the checkpoints here instead of a temporary directory")
    args = parser.parse_args()

    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax
    from flax import nnx

    import nnxscale
    from nnxscale.models import llama

    work = args.keep or Path(tempfile.mkdtemp(prefix="llama_hf_check_"))
    work.mkdir(parents=True, exist_ok=True)
    tokens = np.asarray(np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (BATCH, SEQ_LEN)), np.int32)
    np.save(work / "tokens.npy", tokens)
    forward = jax.jit(lambda graphdef, state, tokens: nnx.merge(graphdef, state)(tokens), static_argnums=0)
    mesh = nnxscale.make_mesh("data=2,model=4")
    rules = nnxscale.resolve(None, mesh, min_shard_bytes=0)

    def logits(model, on_mesh=False):
        graphdef, state = nnx.split(model)
        if not on_mesh:
            return np.asarray(forward(graphdef, state, tokens))

        @jax.jit
        def sharded(state, tokens):
            with nnxscale.use_rules(rules):
                return nnx.merge(graphdef, state)(tokens)

        batch = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, rules.batch_spec()))
        return np.asarray(sharded(state, batch))

    def hf(command, directory, spec=None):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        cmd = [args.hf_python, __file__, "--hf-side", command, str(directory), json.dumps(spec or {})]
        subprocess.run(cmd, check=True, env=env)
        return np.load(directory / "hf_logits.npy")

    rows = []

    def compare(direction, case, ours, reference):
        err = float(np.abs(ours - reference).max())
        scale = float(np.abs(reference).max())
        rows.append((direction, case, err, err / scale, scale))

    for tied, shard in ((False, None), (True, 60_000)):
        case = ("tied" if tied else "untied") + (", sharded files" if shard else ", one file")
        # HF -> nnxscale
        directory = work / f"hf_{'tied' if tied else 'untied'}"
        reference = hf("make", directory, {**CONFIG, "tie_word_embeddings": tied, "max_shard_size": shard or "10GB"})
        assert (directory / "model.safetensors.index.json").exists() == bool(shard), sorted(os.listdir(directory))
        compare("HF -> nnxscale", case, logits(llama.from_pretrained(directory)), reference)
        on_mesh = llama.from_pretrained(directory, mesh=mesh, rules=rules)
        compare("HF -> nnxscale", case + ", data=2,model=4", logits(on_mesh, on_mesh=True), reference)
        # nnxscale -> HF
        cfg = llama.LlamaConfig(**CONFIG, tie_word_embeddings=tied)
        model = llama.Llama(cfg, rngs=nnx.Rngs(1))
        state = nnx.state(model, nnx.Param)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        randomized = [
            (1 + 0.1 * jax.random.normal(k, x.shape) if "norm" in jax.tree_util.keystr(p) else 0.05 * jax.random.normal(k, x.shape))
            for (p, x), k in zip(leaves, keys)
        ]  # fmt: skip
        nnx.update(model, jax.tree.unflatten(treedef, randomized))
        directory = work / f"nnxscale_{'tied' if tied else 'untied'}"
        llama.save_pretrained(model, directory, max_shard_bytes=shard)
        compare("nnxscale -> HF", case, hf("load", directory), logits(model))

    print(f"\nLlama logits, float32, batch {BATCH} x {SEQ_LEN} tokens, config {json.dumps(CONFIG)}")
    print(f"{'direction':<16} {'case':<34} {'max abs err':>12} {'rel to max':>11} {'max |logit|':>12}")
    for direction, case, err, rel, scale in rows:
        print(f"{direction:<16} {case:<34} {err:>12.3e} {rel:>11.3e} {scale:>12.3f}")
    worst = max(r[2] for r in rows)
    print(f"worst: {worst:.3e} ({'within' if worst <= args.tolerance else 'OVER'} tolerance {args.tolerance:g}); files in {work}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--hf-side":
        hf_side(*sys.argv[2:5])
    else:
        sys.exit(main())
