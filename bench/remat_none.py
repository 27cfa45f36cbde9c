"""``--remat none`` against ``dots`` and ``full`` on the H100 compiler: llm.c's GPT-2 1558M step,
each model family, and how the peak grows with depth.

    python bench/remat_none.py                      # every table (a few minutes on 2 cores)
    python bench/remat_none.py --tables llmc        # one of: llmc, families, depth

Every figure is ``nnxscale plan --target h100x8`` through the Python API
(:func:`nnxscale.planning.plan`): the training step compiled deviceless by XLA:GPU, its peak
memory per GPU from the compiler and its step time predicted over the compiled program
(:mod:`nnxscale.planning.steptime`). Needs the ``cuda13`` (or ``cuda12``) extra.

- ``llmc``: llm.c's GPT-2 1558M run on 8 H100s as its script sets it (data=8, 16 x 1,024
  tokens per GPU, 8 accumulation steps, bfloat16, no recompute), beside llm.c's measured
  2.80 s per step: the ratio predicted / measured per policy, and none's step over dots'.
- ``families``: one small configuration per family (GPT-2, Llama, Mixtral, Qwen3, Gemma 3,
  DeepSeek; the two mixtures as config.json files 1,024 wide), data=8: none's predicted step
  over dots' and over full's (at most 1 each: a step that recomputes nothing must not be
  predicted slower than one that recomputes).
- ``depth``: GPT-2 (768 wide) at 12, 24 and 48 layers, ``--remat none``: the peak's growth
  per layer from 12 to 24 and from 24 to 48 layers (within 10% of each other: linear).

The last line is JSON.

Before issue 49's fix (2026-12-07, jax 0.12.0.1 with the CUDA 13 plugin, 2 cores, about 8
minutes; ``none`` then meant no ``jax.checkpoint`` around the scanned layer): llm.c's step
with ``none`` 121.5 GiB per GPU (does not fit), 5.80 s (2.07x llm.c's; 2.36e15 compiled matrix
FLOPs, XLA:GPU recomputing GEMMs past its memory limit), ``dots`` 51.1 GiB and 2.96 s (1.06x),
``full`` 32.4 GiB and 3.10 s; ``none`` over ``dots``: gpt2-medium 1.24, llama-3.2-1b 1.11,
qwen3-0.6b 1.15, mixtral-mini 0.88, deepseek-mini 0.92 (the mixtures' all-to-alls are not
exchanged again); gemma-3-1b did not compile (its fix: f6a67c1). The depth: 578 MiB per layer
from 12 to 24 and from 24 to 48 layers, linear already.

After (2026-12-07, jax 0.12.1 with the CUDA 13 plugin, 12 minutes): llm.c's step with
``none`` 51.1 GiB per GPU (fits), 3.02 s (1.08x llm.c's), 1.244e15 compiled matrix FLOPs;
``dots`` the same program; ``full`` 32.4 GiB, 3.16 s, 1.502e15. ``none`` over ``dots`` 1.000
for every family; over ``full``: gpt2-medium 0.989, llama-3.2-1b 0.952, mixtral 8 x 1024
0.998, qwen3-0.6b 0.998, gemma-3-1b 0.932, deepseek 6 x 1024 0.998 (the mixtures' steps are
memory- and launch-bound on XLA:GPU, MFU 4-9%: their experts run as a loop of tiles there).
At the mini presets (128 wide, 0.1 GiB per GPU, a step of 7-8 ms of launches) ``full`` was
predicted 1.3% (mixtral-mini) and 0.5% (deepseek-mini) faster than ``none``: the rows above
are 1,024 wide for that reason.
The depth: 216.2 MiB per layer from 12 to 24 and from 24 to 48 layers (8 x 1,024 tokens per
GPU), ratio 1.000.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

LLMC_SECONDS = 2.80  # llm.c, GPT-2 1558M on 8 H100s (bench/published_runs.json: llmc-gpt2-1558m-h100x8)
LLMC = dict(model="gpt2-xl", mesh="data=8", batch=1024, seq=1024, accum=8)
# The mixtures at a width where their products cost something (the mini presets, 128 wide and
# 0.1 GiB per GPU, time op launches): Hugging Face config.json files, as `plan --model DIR` reads them.
MIXTRAL_1024 = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 3584,
                "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
                "max_position_embeddings": 4096, "num_local_experts": 8, "num_experts_per_tok": 2}
DEEPSEEK_1024 = {"model_type": "deepseek_v3", "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
                 "moe_intermediate_size": 704, "num_hidden_layers": 6, "first_k_dense_replace": 1,
                 "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 512, "kv_lora_rank": 256,
                 "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "n_routed_experts": 16,
                 "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
                 "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_interleave": True,
                 "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "original_max_position_embeddings": 1024}}
FAMILIES = [  # (label, preset or config.json fields, global batch, seq): each a step of a few GiB per GPU
    ("gpt2-medium", "gpt2-medium", 64, 1024),
    ("llama-3.2-1b", "llama-3.2-1b", 32, 2048),
    ("mixtral 8 x 1024", MIXTRAL_1024, 32, 2048),
    ("qwen3-0.6b", "qwen3-0.6b", 32, 2048),
    ("gemma-3-1b", "gemma-3-1b", 32, 2048),
    ("deepseek 6 x 1024", DEEPSEEK_1024, 32, 2048),
]
DEPTHS = (12, 24, 48)


def command(model, mesh, batch, seq, accum, remat) -> str:
    acc = f" --grad-accum {accum}" if accum > 1 else ""
    return (f"nnxscale plan --model {model} --target h100x8 --mesh {mesh} --batch-size {batch}{acc} --seq-len {seq} "
            f"--dtype bfloat16 --remat {remat}")  # fmt: skip


def planned(model, mesh, batch, seq, accum, remat) -> dict:
    from nnxscale.planning import plan
    from nnxscale.training.config import TrainConfig, with_overrides

    fields = {"model.name": model, "parallel.mesh": mesh, "data.batch_size": batch, "data.seq_len": seq,
              "optim.grad_accum": accum, "model.dtype": "bfloat16", "model.remat": remat}  # fmt: skip
    cfg = with_overrides(TrainConfig(), fields)
    t = time.perf_counter()
    p = plan(cfg, target="h100x8", compare=False)
    st = p.step_time
    return {"model": str(model), "remat": remat, "peak_gib": p.peak_bytes / 2**30, "fits": p.fits,
            "step_s": st.seconds if st else None, "flops": p.flops, "seconds": time.perf_counter() - t,
            "command": command(model, mesh, batch, seq, accum, remat)}  # fmt: skip


def llmc_table() -> list[dict]:
    rows = [planned(LLMC["model"], LLMC["mesh"], LLMC["batch"], LLMC["seq"], LLMC["accum"], r) for r in ("none", "dots", "full")]
    print(f"llm.c's GPT-2 1558M on h100x8 (measured {LLMC_SECONDS:.2f} s per step, no recompute):")
    print(f"  {'--remat':8} {'peak per GPU':>14} {'fits':>5} {'predicted':>10} {'/ llm.c':>8} {'compiled FLOPs':>15}")
    for r in rows:
        r["ratio_to_llmc"] = r["step_s"] / LLMC_SECONDS
        print(f"  {r['remat']:8} {r['peak_gib']:11.1f} GiB {'yes' if r['fits'] else 'no':>5} {r['step_s']:8.2f} s "
              f"{r['ratio_to_llmc']:8.2f} {r['flops']:15.3e}")  # fmt: skip
    print(f"  none / dots: {rows[0]['step_s'] / rows[1]['step_s']:.3f}; {rows[0]['command']}")
    return rows


def families_table() -> list[dict]:
    out = []
    print("each family, data=8, bfloat16: none's predicted step over dots' and full's")
    with tempfile.TemporaryDirectory() as tmp:
        for label, model, batch, seq in FAMILIES:
            if isinstance(model, dict):
                d = Path(tmp) / label.replace(" ", "")
                d.mkdir()
                (d / "config.json").write_text(json.dumps(model))
                model = str(d)
            by = {r: planned(model, "data=8", batch, seq, 1, r) for r in ("none", "dots", "full")}
            row = {"model": label, **{f"{r}_s": by[r]["step_s"] for r in by}, **{f"{r}_gib": by[r]["peak_gib"] for r in by}}
            cells = []
            for r in by:  # a plan without a step time (no compiled schedule to time) says so
                step = "no step time" if row[f"{r}_s"] is None else f"{row[f'{r}_s'] * 1e3:8.1f} ms"
                cells.append(f"{r} {step} {row[f'{r}_gib']:6.1f} GiB")
            if all(row[f"{r}_s"] for r in by):
                row["none_over_dots"], row["none_over_full"] = row["none_s"] / row["dots_s"], row["none_s"] / row["full_s"]
                cells.append(f"none/dots {row['none_over_dots']:.3f} none/full {row['none_over_full']:.3f}")
            print(f"  {label:18} " + " | ".join(cells))
            out.append(row)
    return out


def depth_table() -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in DEPTHS:  # GPT-2 124M's config.json at other depths: plan --model DIR reads config.json alone
            d = Path(tmp) / f"gpt2-{n}"
            d.mkdir()
            (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": n, "n_embd": 768, "n_head": 12,
                                                       "n_positions": 1024, "vocab_size": 50257}))  # fmt: skip
            out.append({"layers": n, **planned(str(d), "data=8", 64, 1024, 1, "none")})
    print("GPT-2 768 wide, data=8, 8 x 1,024 tokens per GPU, --remat none: the peak per layer")
    for a, b in zip(out, out[1:]):
        b["gib_per_layer"] = (b["peak_gib"] - a["peak_gib"]) / (b["layers"] - a["layers"])
    for r in out:
        per = f"{r['gib_per_layer'] * 1024:.1f} MiB per layer since the row above" if "gib_per_layer" in r else ""
        print(f"  {r['layers']:3} layers: peak {r['peak_gib']:6.2f} GiB  {per}")
    growth = [r["gib_per_layer"] for r in out if "gib_per_layer" in r]
    print(f"  per-layer growth 24->48 over 12->24: {growth[1] / growth[0]:.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", default="llmc,families,depth")
    args = ap.parse_args()
    tables = {"llmc": llmc_table, "families": families_table, "depth": depth_table}
    out = {}
    for name in args.tables.split(","):
        out[name] = tables[name]()
        print()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
