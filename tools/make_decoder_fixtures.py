"""Write the small Hugging Face checkpoints of the newer decoder families the test suite checks against.

Run by hand, once, with PyTorch and transformers kept out of the project's environment::

    python3.11 -m venv /work/venvs/ref
    /work/venvs/ref/bin/pip install torch==2.13.0 transformers safetensors numpy  # a CPU build of torch will do
    python3 tools/make_decoder_fixtures.py --hf-python /work/venvs/ref/bin/python [NAME ...]

For each fixture below (all of them when no NAME is given) Hugging Face's own model class
builds a tiny random model from a config dict, every parameter (and DeepSeek's
``e_score_correction_bias`` buffer) is set to random values far from its initial ones (norm
scales near 1 — near 0 for Gemma's, whose scale is ``1 + w`` —, random biases, other weights
``N(0, scale²)``), and ``save_pretrained`` writes it to ``tests/data/<name>/model``; its float32
eager-attention logits for ``tests/data/<name>/tokens.npy`` (shape (2, 24)) go to
``model/hf_logits.npy`` (shape (2, 24, vocab)). The reference side checks that the logits are
deterministic, that the written checkpoint reloads to the same logits, that no saved tensor
kept its initial value, and that the switches under test matter (sliding windows shorter than
the 24 tokens, Gemma 2's soft caps out of tanh's linear range, DeepSeek's score-correction
bias changing the routing). The tests load those directories with nnxscale and compare logits:
an independent reference in CI, with nothing downloaded and no torch installed.

Fixtures (transformers 5.25.0, torch 2.13.0+cpu made the committed ones):

- ``hf_qwen2``: Qwen2 (q/k/v biases), tied head, no sliding window.
- ``hf_qwen3``: Qwen3 (q/k RMSNorm per head, head_dim 16 with hidden 32), YaRN (factor 4
  from 16 positions), separate head.
- ``hf_qwen3_moe``: Qwen3-MoE, 8 experts top 2, no top-k renormalisation, 4 layers of which
  layer 1 is dense (``mlp_only_layers=[1]``; a layer is sparse when it is not listed there and
  ``(layer + 1) % decoder_sparse_step == 0``).
- ``hf_qwen3_moe_norm``: the same with ``norm_topk_prob`` and 2 layers, both sparse.
- ``hf_mistral``: Mistral with a sliding window of 8 in every layer, head_dim 16.
- ``hf_gemma2``: Gemma 2, layers sliding/global/sliding/global (window 8), attention soft cap
  5, final soft cap 3, ``query_pre_attn_scalar`` 24 with head_dim 16, tied head.
- ``hf_gemma3_text``: Gemma 3 text (``Gemma3ForCausalLM``), 7 layers from
  ``sliding_window_pattern`` 6: layers 0-4 and 6 sliding (window 8, theta 1e4), layer 5 global
  (theta 1e6, linear scaling 8); q/k norms; tied head.
- ``hf_gemma3``: a ``Gemma3ForConditionalGeneration`` checkpoint (tiny SigLIP tower), text
  layers sliding/global/sliding; the logits are the text tower's (no pixel values).
- ``hf_deepseek_v3``: DeepSeek-V3 (MLA with q LoRA, 8 routed experts in 4 groups, top-2
  groups, top 2, a shared expert, layer 0 dense, sigmoid router with score-correction bias,
  routed scaling 2.5, YaRN factor 4 with mscale_all_dim 1 scaling the softmax).
- ``hf_deepseek_v2_lite_style``: the same class with ``q_lora_rank`` None (a plain q_proj),
  no rope scaling.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "tests" / "data"
T = 24  # tokens per row: longer than the sliding windows of 8

_QWEN3_MOE = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
    rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
    mlp_only_layers=[1], router_aux_loss_coef=0.001, tie_word_embeddings=False, use_sliding_window=False,
)  # fmt: skip
_GEMMA3_TEXT = dict(
    vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=7, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=6,
    rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
    final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
)  # fmt: skip
_DEEPSEEK_V3 = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                  "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
)  # fmt: skip

# name: config class, model class, config kwargs, scale of the weight matrices (and token_limit)
FIXTURES: dict[str, dict] = {
    "hf_qwen2": dict(
        config="Qwen2Config", model="Qwen2ForCausalLM", scale=0.2,
        kwargs=dict(vocab_size=112, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=True, use_sliding_window=False, sliding_window=None),
    ),
    "hf_qwen3": dict(
        config="Qwen3Config", model="Qwen3ForCausalLM", scale=0.2,
        kwargs=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
                    rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    ),
    "hf_qwen3_moe": dict(config="Qwen3MoeConfig", model="Qwen3MoeForCausalLM", scale=0.2, kwargs=_QWEN3_MOE),
    "hf_qwen3_moe_norm": dict(
        config="Qwen3MoeConfig", model="Qwen3MoeForCausalLM", scale=0.2,
        kwargs={**_QWEN3_MOE, "norm_topk_prob": True, "mlp_only_layers": [], "num_hidden_layers": 2},
    ),
    "hf_mistral": dict(
        config="MistralConfig", model="MistralForCausalLM", scale=0.2,
        kwargs=dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
                    rope_theta=10000.0, sliding_window=8, tie_word_embeddings=False),
    ),
    "hf_gemma2": dict(
        config="Gemma2Config", model="Gemma2ForCausalLM", scale=0.3,
        kwargs=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
                    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=8,
                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0, rope_theta=10000.0,
                    tie_word_embeddings=True),
    ),
    "hf_gemma3_text": dict(config="Gemma3TextConfig", model="Gemma3ForCausalLM", scale=0.2, kwargs=_GEMMA3_TEXT),
    "hf_gemma3": dict(
        config="Gemma3Config", model="Gemma3ForConditionalGeneration", scale=0.2, token_limit=125,
        kwargs=dict(
            text_config={**{k: v for k, v in _GEMMA3_TEXT.items() if k != "sliding_window_pattern"},
                         "num_hidden_layers": 3,
                         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
            vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                               num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8,
                               num_channels=3, vision_use_head=False),
            mm_tokens_per_image=4, boi_token_index=125, eoi_token_index=126, image_token_index=127,
            tie_word_embeddings=True,
        ),
    ),
    "hf_deepseek_v3": dict(config="DeepseekV3Config", model="DeepseekV3ForCausalLM", scale=0.2, kwargs=_DEEPSEEK_V3),
    "hf_deepseek_v2_lite_style": dict(
        config="DeepseekV3Config", model="DeepseekV3ForCausalLM", scale=0.2,
        kwargs={**{k: v for k, v in _DEEPSEEK_V3.items() if k != "rope_scaling"}, "q_lora_rank": None},
    ),
    "hf_deepseek_v2": dict(
        config="DeepseekV2Config", model="DeepseekV2ForCausalLM", scale=0.2,
        kwargs={**{k: v for k, v in _DEEPSEEK_V3.items() if k not in ("norm_topk_prob",)}, "q_lora_rank": None,
                "topk_method": "group_limited_greedy", "routed_scaling_factor": 2.0},
    ),
}  # fmt: skip


def vocab_of(spec: dict) -> int:
    kwargs = spec["kwargs"]
    return kwargs["text_config"]["vocab_size"] if "text_config" in kwargs else kwargs["vocab_size"]


def hf_side(directory: str, name: str) -> None:
    """Runs in the reference environment: torch and transformers, no nnxscale."""
    import torch
    import transformers
    from safetensors.torch import load_file

    transformers.utils.logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    spec = FIXTURES[name]
    directory = Path(directory)
    tokens = torch.tensor(np.load(directory.parent / "tokens.npy"), dtype=torch.long)
    config = getattr(transformers, spec["config"])(
        **spec["kwargs"], attn_implementation="eager", experts_implementation="eager"
    )
    torch.manual_seed(0)
    model = getattr(transformers, spec["model"])(config).eval()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    scale = spec["scale"]
    with torch.no_grad():  # every weight random, so that a wrong mapping shows
        for module in model.modules():
            kind = type(module).__name__
            norm = isinstance(module, torch.nn.LayerNorm) or "RMSNorm" in kind
            for pname, p in module.named_parameters(recurse=False):
                r = torch.randn_like(p)
                if norm and pname == "weight":  # Gemma's RMSNorm scales by (1 + w): w near 0
                    p.copy_(0.1 * r if kind.startswith("Gemma") else 1 + 0.1 * r)
                elif pname == "bias" or pname.endswith("_bias"):
                    p.copy_(0.1 * r)
                else:
                    p.copy_(scale * r)
            for bname, b in module.named_buffers(recurse=False):
                if bname == "e_score_correction_bias":  # DeepSeek's router: large enough to change choices
                    b.copy_(0.3 * torch.randn_like(b))
        logits = model(tokens).logits.float()
        again = model(tokens).logits.float()
    assert torch.equal(logits, again), "logits are not deterministic"
    state = model.state_dict()
    same = [k for k, v in state.items() if torch.equal(v, initial[k])]
    assert not same, f"kept their initial values: {same}"
    model.save_pretrained(directory, safe_serialization=True)
    np.save(directory / "hf_logits.npy", logits.numpy())

    saved = load_file(directory / "model.safetensors")
    constant = [k for k, v in saved.items() if v.numel() > 1 and float(v.float().std()) == 0.0]
    assert not constant, f"constant tensors saved: {constant}"
    reloaded = type(model).from_pretrained(directory, attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(tokens).logits.float(), logits), "the saved checkpoint gives other logits"
    prefixes = sorted({".".join(k.split(".")[:2]) if k.split(".")[0] == "model" else k.split(".")[0] for k in saved})

    head = (f"{name}: {spec['model']}, logits {tuple(logits.shape)} std {float(logits.std()):.3f} "
            f"max|.| {float(logits.abs().max()):.3f}; {len(saved)} tensors, prefixes {prefixes}")  # fmt: skip
    lines = [head]
    cfg = model.config.get_text_config()
    if getattr(cfg, "layer_types", None):
        lines.append(f"  layer_types {cfg.layer_types}")
    lines.append(f"  rope_parameters {cfg.rope_parameters}")
    lines += _checks(model, tokens, logits, name)
    print("\n".join(lines), flush=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", flush=True)


def _checks(model, tokens, logits, name: str) -> list[str]:
    """Shows that each switch under test changes the logits (and how hard Gemma 2's soft caps bite)."""
    import torch
    import transformers

    lines = []
    text_config = model.config.get_text_config()
    layers = getattr(model.model, "language_model", model.model).layers

    def changed(what: str, objects: list, **attrs) -> None:  # logits with some attributes set otherwise
        old = [{k: getattr(o, k) for k in attrs} for o in objects]
        try:
            for o in objects:
                for k, v in attrs.items():
                    setattr(o, k, v)
            with torch.no_grad():
                other = model(tokens).logits.float()
        finally:
            for o, values in zip(objects, old):
                for k, v in values.items():
                    setattr(o, k, v)
        diff = float((other - logits).abs().max())
        assert diff > 1e-3, f"{what} changes nothing"
        lines.append(f"  without {what}: logits change by up to {diff:.3f}")

    if name == "hf_mistral" or name.startswith("hf_gemma"):  # the masks read config.sliding_window
        changed("the sliding window", [text_config], sliding_window=4 * T)
    if name == "hf_gemma2":
        seen = []
        module = transformers.models.gemma2.modeling_gemma2
        original = module.eager_attention_forward

        def spy(mod, query, key, value, attention_mask, *args, **kwargs):
            scores = torch.matmul(query, module.repeat_kv(key, mod.num_key_value_groups).transpose(2, 3))
            seen.append(float((scores * mod.scaling).abs().max()))
            return original(mod, query, key, value, attention_mask, *args, **kwargs)

        module.eager_attention_forward = spy
        try:
            with torch.no_grad():
                model(tokens)
        finally:
            module.eager_attention_forward = original
        cap = text_config.attn_logit_softcapping
        lines.append(f"  attention scores before the soft cap {cap}: max|.| per layer {[round(x, 2) for x in seen]}")
        changed("the attention soft cap", [layer.self_attn for layer in layers], attn_logit_softcapping=None)
        changed("the final soft cap", [text_config], final_logit_softcapping=None)
    if name.startswith("hf_deepseek") and name != "hf_deepseek_v2":  # V2's router has no correction bias
        gates = [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate")]
        kept = [g.e_score_correction_bias.clone() for g in gates]
        try:
            for g in gates:
                g.e_score_correction_bias.zero_()
            with torch.no_grad():
                diff = float((model(tokens).logits.float() - logits).abs().max())
        finally:
            for g, b in zip(gates, kept):
                g.e_score_correction_bias.copy_(b)
        assert diff > 1e-3, "e_score_correction_bias changes nothing"
        lines.append(f"  without e_score_correction_bias: logits change by up to {diff:.3f}")
        attn = layers[0].self_attn
        lines.append(f"  softmax scale {attn.scaling:.6f} (qk_head_dim**-0.5 = {attn.qk_head_dim ** -0.5:.6f}); "
                     f"rope attention_scaling {model.model.rotary_emb.attention_scaling}")  # fmt: skip
    if name == "hf_qwen3":
        lines.append(f"  rope attention_scaling (YaRN, on cos/sin) {model.model.rotary_emb.attention_scaling}")
    if name == "hf_gemma3":  # the text tower alone, as a Gemma3ForCausalLM, gives the same logits
        text = transformers.Gemma3ForCausalLM(text_config).eval()
        weights = {f"model.{k}": v for k, v in model.model.language_model.state_dict().items()}
        text.load_state_dict({**weights, "lm_head.weight": model.lm_head.weight}, strict=True)
        with torch.no_grad():
            diff = float((text(tokens).logits.float() - logits).abs().max())
        assert diff < 1e-5, diff
        lines.append(f"  the text tower as Gemma3ForCausalLM: max|diff| {diff:.2e}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"fixtures to make (default: all of {', '.join(FIXTURES)})")
    parser.add_argument("--hf-python", default="/work/venvs/ref/bin/python", help="python with torch and transformers")
    parser.add_argument("--hf-side", nargs=2, metavar=("DIR", "NAME"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_side:
        hf_side(*args.hf_side)
        return 0
    for name in args.names or FIXTURES:
        spec, out = FIXTURES[name], DATA / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        limit = spec.get("token_limit", vocab_of(spec))  # Gemma 3's image tokens lie above the text ones
        np.save(out / "tokens.npy", np.random.default_rng(0).integers(0, limit, size=(2, T)))
        subprocess.run([args.hf_python, __file__, "--hf-side", str(out / "model"), name], check=True)
        for path in sorted(out.rglob("*")):
            if path.is_file():
                print(f"  {path.relative_to(DATA)}: {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
