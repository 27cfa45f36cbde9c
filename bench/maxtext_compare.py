"""nnxscale's compiled train step beside MaxText's, for the same model, mesh, batch, sequence
and precision on the same TPU topology (deviceless): memory per chip, FLOPs, collectives.

Each side runs in its own virtual environment and prints one JSON line per case; MaxText is
never a dependency of nnxscale:

    # nnxscale's side, in nnxscale's environment (with jax[tpu] installed):
    flock /tmp/nnxscale-heavy.lock python bench/maxtext_compare.py --side nnxscale --case llama-20m
    # MaxText's side: Python 3.12, maxtext 0.2.5, jax and jax[tpu] pinned to 0.10.2:
    #   python3.12 -m venv /tmp/venv-maxtext
    #   /tmp/venv-maxtext/bin/pip install maxtext==0.2.5 jax==0.10.2 "jax[tpu]==0.10.2" \\
    #       absl-py flax optax orbax-checkpoint omegaconf pyyaml jaxtyping chex aqtp ml-collections \\
    #       pydantic tensorboardx grain sentencepiece tiktoken transformers tensorstore pathwaysutils \\
    #       jinja2 qwix tokamax          (with jax, jaxlib and libtpu pinned by a constraints file)
    flock /tmp/nnxscale-heavy.lock /tmp/venv-maxtext/bin/python bench/maxtext_compare.py --side maxtext --case llama-20m

Then ``--ratio A.jsonl B.jsonl`` prints nnxscale over MaxText for each figure and case.
MaxText 0.2.5 imports ``jax.experimental.xla_metadata.must_fuse_call`` (its flash kernel's;
jax 0.10.2 lacks it): a stub stands in, and MaxText runs ``attention=dot_product`` here, the
same XLA attention nnxscale is told to compile (``--attention xla``; its default on a TPU is
the splash kernel). Memory is the TPU compiler's
``peak_memory_in_bytes``; FLOPs its ``cost_analysis()`` (which counts a loop body once) and
the matrix products of the compiled program, each loop body once per trip
(``matmul_flops``); collectives counted op by op from the compiled program
(``bench/_collectives.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

#: case -> the TPU topology, mesh (one FSDP axis over every chip), global batch, sequence, and
#: the model in both vocabularies: nnxscale's Llama fields and MaxText's config keys.
CASES = {
    "llama-20m": dict(
        topology="v5p-8", chips=4, batch=8, seq=1024,
        nnxscale=dict(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=False),
        maxtext=dict(base_emb_dim=256, base_num_query_heads=4, base_num_kv_heads=4, head_dim=64, base_mlp_dim=1024,
                     base_num_decoder_layers=4, vocab_size=32000, logits_via_embedding=False, decoder_block="llama2",
                     mlp_activations='["silu","linear"]', rope_max_timescale=10000),
    ),
    # MaxText's own v5p recipe for a 7-8B Llama (configs/tpu/v5p/llama2_7b.sh): 4 x 4,096 tokens per chip.
    "llama-3.1-8b": dict(
        topology="v5p-16", chips=8, batch=32, seq=4096, nnxscale="llama-3.1-8b", maxtext=dict(model_name="llama3.1-8b"),
    ),
    "llama-3.2-1b": dict(
        topology="v5e-8", chips=8, batch=8, seq=2048, nnxscale="llama-3.2-1b",
        maxtext=dict(base_emb_dim=2048, base_num_query_heads=32, base_num_kv_heads=8, head_dim=64, base_mlp_dim=8192,
                     base_num_decoder_layers=16, vocab_size=128256, logits_via_embedding=True,
                     normalize_embedding_logits=False, decoder_block="llama2", mlp_activations='["silu","linear"]',
                     rope_max_timescale=500000),
    ),
}  # fmt: skip


def nnxscale_side(name: str) -> dict:
    import dataclasses

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from step_waste import compile_step, figures

    from nnxscale.models import FAMILIES
    from nnxscale.training.config import TrainConfig

    case = CASES[name]
    model = case["nnxscale"]
    if isinstance(model, dict):  # a shape no preset has: registered for this run only
        llama = FAMILIES["llama"]
        llama.presets[name] = dataclasses.replace(llama.presets["llama-3.2-1b"], rope_scaling=None, **model)
        model = name
    cfg = TrainConfig.from_flags(model=model, mesh=f"fsdp={case['chips']}", batch_size=case["batch"],
                                 seq_len=case["seq"], dtype="bfloat16", remat="full", attention="xla")  # fmt: skip
    s, compiled, seconds = compile_step(cfg, case["topology"])
    params = sum(x.size for x in __import__("jax").tree.leaves(s.abstract["params"]))
    return {"compile_s": round(seconds, 1), **figures(compiled, params)}


def maxtext_side(name: str) -> dict:
    import jax
    import jax.experimental.xla_metadata as xla_metadata

    if not hasattr(xla_metadata, "must_fuse_call"):  # used only by MaxText's flash kernel, not run here
        xla_metadata.must_fuse_call = lambda *a, **k: (lambda f: f)
    import maxtext
    from maxtext.trainers.pre_train import train_compile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from step_waste import figures

    case = CASES[name]
    box = {}
    jit_and_compile = train_compile.jit_and_compile

    def keep(*args, **kwargs):
        box["compiled"] = jit_and_compile(*args, **kwargs)
        box["params"] = sum(x.size for x in jax.tree.leaves(_params(args[1][0])))
        return box["compiled"]

    train_compile.jit_and_compile = keep
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    keys = dict(case["maxtext"], per_device_batch_size=case["batch"] // case["chips"], max_target_length=case["seq"],
                dtype="bfloat16", weight_dtype="float32", remat_policy="full", attention="dot_product",
                ici_fsdp_parallelism=case["chips"], ici_data_parallelism=1, compile_topology=case["topology"],
                compile_topology_num_slices=1, dataset_type="synthetic", enable_checkpointing=False,
                run_name="maxtext_compare", base_output_directory="/tmp/maxtext_compare", skip_jax_distributed_system=True)  # fmt: skip
    t0 = time.perf_counter()
    train_compile.main(["train_compile", base, *(f"{k}={v}" for k, v in keys.items())])
    return {"compile_s": round(time.perf_counter() - t0, 1), **figures(box["compiled"], box["params"])}


def _params(state) -> object:
    """The parameters of MaxText's abstract train state (Linen ``TrainState`` or NNX)."""
    for key in ("params", "model"):
        if hasattr(state, key):
            return getattr(state, key)
        if isinstance(state, dict) and key in state:
            return state[key]
    return state


def ratios(ours: str, theirs: str) -> None:
    """nnxscale over MaxText, per case and figure, from the two sides' JSON lines."""
    read = lambda path: {r["case"]: r for r in map(json.loads, open(path))}  # noqa: E731
    a, b = read(ours), read(theirs)
    for name in a.keys() & b.keys():
        x, y = a[name], b[name]
        out = {"case": name, "memory": x["memory_MB"] / y["memory_MB"]}
        if x.get("flops") and y.get("flops"):
            out["flops"] = x["flops"] / y["flops"]
        if x.get("matmul_flops") and y.get("matmul_flops"):
            out["matmul_flops"] = x["matmul_flops"] / y["matmul_flops"]
        cx, cy = sum(x["collectives_MB"].values()), sum(y["collectives_MB"].values())
        out["collectives"] = cx / cy if cy else None
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=("nnxscale", "maxtext"))
    p.add_argument("--case", choices=sorted(CASES), action="append", help="default: every case")
    p.add_argument("--ratio", nargs=2, metavar=("NNXSCALE_JSONL", "MAXTEXT_JSONL"))
    a = p.parse_args(argv)
    if a.ratio:
        ratios(*a.ratio)
        return 0
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax

    jax.config.update("jax_platforms", "cpu")
    side = nnxscale_side if a.side == "nnxscale" else maxtext_side
    for name in a.case or CASES:
        case = CASES[name]
        print(json.dumps({"case": name, "side": a.side, "topology": case["topology"], "mesh": f"fsdp={case['chips']}",
                          "batch": [case["batch"], case["seq"]], **side(name)}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
