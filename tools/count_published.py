"""Count the parameters of published decoder checkpoints with Hugging Face's own model classes.

Run by hand in the reference environment (torch and transformers, never the project's)::

    python3.11 -m venv /work/venvs/ref
    /work/venvs/ref/bin/pip install torch==2.13.0 transformers safetensors numpy  # a CPU build of torch will do
    /work/venvs/ref/bin/python tools/count_published.py [--out tools/published_counts.json]

Each preset below is the architecture part of a published ``config.json``, spelled as that file
spells it (no hub access here: the dicts are written out, with where each came from). The
transformers class named by ``architectures`` is built from it on the meta device (no memory,
no weights), and the exact parameter count is ``sum(p.numel() for p in model.parameters())``
(tied weights, being one parameter, count once). For the mixtures of experts the parameters
used per token are that total less the routed experts a token does not choose, from the config
(embeddings and head included). The counts, the config dicts and the transformers version go to
``tools/published_counts.json``, which the project's tests may read without torch.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Sources (no field below was guessed; where two copies differ, the note says which won):
# [maxtext]  AI-Hypercomputer/maxtext src/maxtext/checkpoint_conversion/utils/hf_model_configs.py
#            (commit e591f30c) and src/maxtext/configs/models/*.yml
# [infersim] alibaba/InferSim hf_configs/*.json (commit f2293dab): config.json files copied verbatim
# [hf-conv]  huggingface/transformers src/transformers/models/gemma3/convert_gemma3_weights.py (its
#            _VARIANTS; with the vision tower it grows the embedding by 64 rows: vocab_size += 64)
# [trtllm]   NVIDIA/TensorRT-LLM tests/unittest/_torch/modeling/test_modeling_gemma3.py (published
#            gemma-3-1b-pt and gemma-3-27b-it config.json with the layer count cut for testing)
# [vllm]     vllm-project/vllm issue #10548, which quotes google/gemma-2-9b-it's config.json
# [fusion]   tanganke/fusion_bench docs and tests: MistralConfig(**{...}) "from
#            https://huggingface.co/mistralai/Mistral-7B-v0.1/resolve/main/config.json"
PUBLISHED: dict[str, dict] = {
    # Qwen/Qwen3-0.6B: [maxtext] qwen3_0_6b_config and qwen3-0.6b.yml (tied head)
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "max_window_layers": 28,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "use_sliding_window": False, "attention_bias": False, "tie_word_embeddings": True,
    },
    # Qwen/Qwen3-8B: [infersim] qwen3-8B_config.json; [maxtext] qwen3_8b_config agrees
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "max_window_layers": 36,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "use_sliding_window": False, "attention_bias": False, "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-32B: [maxtext] qwen3_32b_config and qwen3-32b.yml
    "qwen3-32b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120,
        "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "max_window_layers": 64,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "use_sliding_window": False, "attention_bias": False, "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-30B-A3B: [infersim] qwen3-30B-A3B_config.json; [maxtext] qwen3_30b_a3b_base_config agrees
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 40960, "max_window_layers": 48, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
        "use_sliding_window": False, "attention_bias": False, "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-235B-A22B: [infersim] qwen3-235B-A22B_config.json and [maxtext]
    # qwen3_235b_a22b_thinking_2507_config are the 2507 releases (rope_theta 5000000, 262144 positions);
    # the first release, written here, has rope_theta 1000000.0 and 40960 positions, nothing else differs.
    "qwen3-235b-a22b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 40960, "max_window_layers": 94, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
        "use_sliding_window": False, "attention_bias": False, "tie_word_embeddings": False,
    },
    # mistralai/Mistral-7B-v0.1: [fusion] (same in several other vendored copies); v0.2/v0.3 differ
    # (rope_theta 1e6, no sliding window, v0.3 vocab 32768), as in [maxtext] mistral-7b.yml
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False,
    },
    # google/gemma-2-9b(-it): [vllm] quotes the config.json; [maxtext] gemma2-9b.yml agrees on the shapes
    # (its hf_model_configs.py says query_pre_attn_scalar 224, the published file 256 = head_dim)
    "gemma-2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 3584,
        "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
        "sliding_window": 4096, "sliding_window_size": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "attention_bias": False, "cache_implementation": "hybrid",
    },
    # google/gemma-3-1b-pt: [trtllm] GEMMA3_1B_CONFIG (26 layers and window 512 restored, as in [hf-conv])
    "gemma-3-1b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "attention_bias": False, "cache_implementation": "hybrid",
    },
    # google/gemma-3-27b-it, its "text_config" (the text tower alone, as Gemma3ForCausalLM): [trtllm]
    # GEMMA3_27B_CONFIG (62 layers and window 1024 restored, as in [hf-conv]). The file leaves the rest
    # to Gemma3TextConfig's defaults, written out in IMPLIED below.
    "gemma-3-27b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 128, "hidden_size": 5376,
        "intermediate_size": 21504, "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
    },
    # deepseek-ai/DeepSeek-V2-Lite: [maxtext] deepseek2_16b_dict ("from .../DeepSeek-V2-Lite/blob/main/
    # config.json"; its rope_scaling's extra "rope_theta" key left out); deepseek2-16b.yml agrees
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "attention_bias": False, "tie_word_embeddings": False,
    },
    # deepseek-ai/DeepSeek-V3: [maxtext] deepseek3_671b_dict ("from .../DeepSeek-V3/blob/main/config.json",
    # quantization_config dropped) for the names; rope_scaling as in [infersim] deepseek_v3_config.json
    # (which renames n_routed_experts/n_shared_experts for its own use, so not taken for those)
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "hidden_act": "silu",
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "attention_bias": False, "tie_word_embeddings": False,
    },
}  # fmt: skip

# Fields a published file leaves out, with the values the class defaults to (transformers 5.x) and that
# the released weights have: the 27B's vocabulary is 262144 text tokens + 64 (the embedding table grown
# for the image tokens, [hf-conv]), Gemma 3's defaults for the rest.
IMPLIED: dict[str, dict] = {
    "gemma-3-27b": {
        "vocab_size": 262208, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "tie_word_embeddings": True,
    },
}  # fmt: skip

# Published totals to check against (model cards, papers), in parameters; None: no exact figure known.
EXPECTED: dict[str, tuple[float, float | None]] = {  # (total, active), relative tolerance 1.5%
    "qwen3-0.6b": (0.6e9, None), "qwen3-8b": (8.19e9, None), "qwen3-32b": (32.8e9, None),
    "qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9), "mistral-7b": (7_241_732_096, None),
    "gemma-2-9b": (9.24e9, None), "gemma-3-1b": (1.0e9, None), "gemma-3-27b": (27.0e9, None),
    "deepseek-v2-lite": (15.7e9, 2.4e9), "deepseek-v3": (671e9, 37e9),
}  # fmt: skip


def moe_shape(config: dict) -> tuple[int, int, int, int] | None:
    """(MoE layers, routed experts, experts per token, parameters of one routed expert) or None."""
    layers = config["num_hidden_layers"]
    if config["model_type"] == "qwen3_moe":
        step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or [])
        moe = sum(1 for i in range(layers) if i not in dense and config["num_experts"] > 0 and (i + 1) % step == 0)
        experts = config["num_experts"]
    elif config["model_type"] in ("deepseek_v2", "deepseek_v3"):
        # transformers: layer >= first_k_dense_replace is MoE (moe_layer_freq is 1 in every release)
        assert config.get("moe_layer_freq", 1) == 1
        moe = sum(1 for i in range(layers) if i >= config["first_k_dense_replace"])
        experts = config["n_routed_experts"]
    else:
        return None
    return moe, experts, config["num_experts_per_tok"], 3 * config["hidden_size"] * config["moe_intermediate_size"]


def count(name: str) -> dict:
    import torch
    import transformers

    published = PUBLISHED[name]
    config_dict = copy.deepcopy({**published, **IMPLIED.get(name, {})})  # transformers edits nested dicts
    fields = {k: v for k, v in config_dict.items() if k not in ("architectures", "model_type")}
    config = transformers.CONFIG_MAPPING[config_dict["model_type"]](**fields)
    with torch.device("meta"):
        model = getattr(transformers, config_dict["architectures"][0])(config)
    total = sum(p.numel() for p in model.parameters())  # shared (tied) parameters come once
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    embedding = embedding.numel()
    result = {"model_class": type(model).__name__, "config": published, "total_params": total,
              "embedding_params": embedding, "tied_head": tied}  # fmt: skip
    if name in IMPLIED:
        result["implied_defaults"] = IMPLIED[name]
    moe = moe_shape(config_dict)
    if moe is not None:
        layers, experts, top_k, per_expert = moe
        # the routed experts' parameters, as built, match the config's count
        routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
        assert routed == layers * experts * per_expert, (name, routed, layers * experts * per_expert)
        result.update(moe_layers=layers, routed_experts=experts, experts_per_token=top_k,
                      params_per_routed_expert=per_expert,
                      active_params=total - layers * (experts - top_k) * per_expert)  # fmt: skip
        result["active_params_without_embedding"] = result["active_params"] - embedding
    if config_dict.get("num_nextn_predict_layers"):
        result["note"] = (f"total without the {config_dict['num_nextn_predict_layers']} multi-token-prediction "
                          "layer(s) the checkpoint also holds (transformers does not build them)")  # fmt: skip
    want_total, want_active = EXPECTED[name]
    assert abs(total - want_total) <= 0.015 * want_total, (name, total, want_total)
    if want_active is not None:  # Qwen's "A3B"/"A22B" count the embedding, DeepSeek's 2.4B/37B do not
        active = result["active_params_without_embedding" if name.startswith("deepseek") else "active_params"]
        assert abs(active - want_active) <= 0.05 * want_active, (name, active, want_active)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"presets (default: all of {', '.join(PUBLISHED)})")
    parser.add_argument("--out", default=str(HERE / "published_counts.json"), help="JSON file to write")
    args = parser.parse_args()
    import torch
    import transformers

    results = {}
    for name in args.names or PUBLISHED:
        results[name] = count(name)
        r = results[name]
        print(json.dumps({name: r["config"]}))
        active = f"  active {r['active_params']:>15,}" if "active_params" in r else ""
        print(f"{name:>17}  {r['model_class']:<24} total {r['total_params']:>15,}{active}", flush=True)
    meta = {"transformers": transformers.__version__, "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({"_versions": meta, **results}, indent=1) + "\n")
    print(f"transformers {meta['transformers']}, torch {meta['torch']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
