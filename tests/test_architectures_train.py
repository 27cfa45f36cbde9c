"""The decoder's families in training and sampling: ring attention past a sliding window,
latent attention with experts on an expert axis, a 1F1B pipeline with a stack outside it
(DeepSeek's dense first layer), the KV cache of sliding layers and of latent
attention, LoRA on latent attention and experts with its PEFT export,
and a DPO step.

Every model is a mini preset shrunk for the suite's time (registered for this module only:
``shrunk``); bench/architectures_meshes.py runs the mini presets themselves on every mesh.
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from model_testing import randomize
from test_cli import run_main
from test_train import quiet_train, tiny_cfg

import nnxscale
from nnxscale.models import deepseek, gemma, qwen
from nnxscale.models.common.generate import Sampling, generate
from nnxscale.models.decoder.config import FULL, SLIDING
from nnxscale.models.decoder.model import Decoder
from nnxscale.training.rundir import read_metrics

SMALL = dict(hidden_size=64, num_attention_heads=4)
WINDOW = 8
# 6 layers: five sliding (window 8) to one global, as gemma3-mini; on context=4 a device
# holds 8 of the 32 tokens, so the sliding layers' ring skips the hops past the window.
GEMMA3 = ("gemma3-test", gemma, "gemma3-mini", dict(SMALL, intermediate_size=128, num_key_value_heads=2, head_dim=16,
          num_hidden_layers=6, layer_types=(SLIDING,) * 5 + (FULL,), sliding_window=WINDOW, query_pre_attn_scalar=16))  # fmt: skip
# a dense first layer (`first_layers`: 1F1B's prefix), then two of 8 routed experts + a shared
# one, latent attention
DEEPSEEK = ("deepseek-test", deepseek, "deepseek-mini", dict(SMALL, num_key_value_heads=4, num_hidden_layers=3,
            intermediate_size=128, q_lora_rank=32, kv_lora_rank=16, moe_intermediate_size=32))  # fmt: skip
QWEN3 = ("qwen3-test", qwen, "qwen3-mini", dict(SMALL, intermediate_size=128, num_key_value_heads=2, head_dim=16,
         num_hidden_layers=2))  # fmt: skip
FAMILIES = (GEMMA3, DEEPSEEK, QWEN3)
SHRUNK = {name: module.preset(base, **kw) for name, module, base, kw in FAMILIES}


@pytest.fixture(scope="module", autouse=True)
def shrunk():
    """The shrunk presets, known to ``--model`` (and to export) for this module's tests only."""
    with pytest.MonkeyPatch.context() as mp:
        for name, module, _, _ in FAMILIES:
            mp.setitem(module.PRESETS, name, SHRUNK[name])
        yield


def _losses(tmp_path, data, name, model, mesh, steps=2, seq=32, **kw):
    run_dir = tmp_path / name
    result = quiet_train(tiny_cfg(run_dir, data, model=model, mesh=mesh, steps=steps, data__batch_size=8,
                                  data__seq_len=seq, **kw))  # fmt: skip
    assert result.final_step == steps
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return [r["loss"] for r in records]


@pytest.mark.parametrize("model,mesh,kw", [
    ("gemma3-test", "context=4,data=2", {}),  # window 8 = a device's share of 32 tokens: hops skipped
    ("deepseek-test", "expert=4,data=2", {}),
    # extended: test_pipeline_1f1b's test of stacks outside the pipeline asserts it in the suite
    pytest.param("deepseek-test", "stage=2,data=4", {"parallel.microbatches": 2, "parallel.pipeline_schedule": "1f1b"},
                 marks=pytest.mark.extended),
], ids=["gemma3-context", "deepseek-expert", "deepseek-1f1b"])  # fmt: skip
def test_losses_are_data_8s_on_context_expert_and_1f1b_meshes(tmp_path, text_data, model, mesh, kw):
    want = _losses(tmp_path, text_data, "ref", model, "data=8")
    got = _losses(tmp_path, text_data, "mesh", model, mesh, **kw)
    assert len(set(want)) == 2, want  # it trains: every step's loss differs
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{model} on {mesh}")


@pytest.mark.parametrize("name", ["gemma3-test", "deepseek-test"])
def test_greedy_with_the_cache_is_recomputation_past_the_window(name):
    """Sliding layers' ring cache (gemma3) and latent attention's cache (deepseek): greedy
    tokens equal recomputing the whole sequence, prompts longer than the window (8)."""
    model = randomize(Decoder(SHRUNK[name], rngs=nnx.Rngs(0)), scale=0.2)
    prompts = [[(7 * i) % 200 + 1 for i in range(3 * WINDOW + 1)], [5, 6, 7], [(11 * i) % 250 for i in range(WINDOW + 3)]]
    greedy = Sampling(temperature=0.0)
    cached = generate(model, prompts, max_new_tokens=20, context=64, sampling=greedy, cache=True)
    again = generate(model, prompts, max_new_tokens=20, context=64, sampling=greedy, cache=False)
    assert [len(r) for r in cached] == [20] * 3
    assert cached == again
    assert len({t for r in cached for t in r}) > 3  # not one token repeated: a comparison that can fail


def test_lora_on_latent_attention_and_experts_trains_and_exports_peft(tmp_path, text_data, capsys):
    """Targets q, kv (latent attention's projections) and gate, up, down (the dense layer's
    MLP, the routed experts, the shared experts): the adapters train, and the PEFT export
    names each as PEFT adapts transformers 5's DeepSeek-V3: the attention's as modules, the
    MLPs' as parameters, each layer's experts fused (gate_up_proj of rank 2r, down_proj), whose
    updates test_peft_fuses_each_experts_adapters_exactly checks. tools/peft_check.py runs
    PEFT itself on them (docs/fine-tuning.md)."""
    from safetensors.numpy import load_file

    losses = _losses(tmp_path, text_data, "lora", "deepseek-test", "data=8", steps=2, lora__rank=4,
                     lora__targets="q,kv,gate,up,down", optim__lr=1e-2)  # fmt: skip
    assert losses[1] != losses[0]
    code, _, err = run_main(capsys, ["export", "--run-dir", str(tmp_path / "lora"), "--peft", str(tmp_path / "peft")])
    assert code == 0, err
    tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    p = "base_model.model.model.layers"
    for want in (f"{p}.1.mlp.experts.base_layer.lora_A.weight", f"{p}.2.mlp.experts.lora_B.weight",
                 f"{p}.1.mlp.shared_experts.up_proj.lora_A.weight", f"{p}.0.mlp.gate_proj.lora_A.weight",
                 f"{p}.0.self_attn.kv_a_proj_with_mqa.lora_A.weight", f"{p}.1.self_attn.kv_b_proj.lora_B.weight",
                 f"{p}.0.self_attn.q_a_proj.lora_A.weight", f"{p}.1.self_attn.q_b_proj.lora_B.weight"):  # fmt: skip
        assert want in tensors, sorted(tensors)[:20]
    assert not any("o_proj" in k or ".gate.weight" in k for k in tensors)  # only the targets
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["rank_pattern"] == {r".*\.gate_up_proj": 8}
    assert config["alpha_pattern"] == {r".*\.gate_up_proj": 2 * config["lora_alpha"]}
    assert config["target_parameters"][0] == "mlp.experts.gate_up_proj"  # PEFT's inner wrapper: base_layer
    assert {"mlp.experts.down_proj", "mlp.gate_proj.weight", "mlp.shared_experts.down_proj.weight"} <= set(config["target_parameters"])
    assert not any("proj" in m and "attn" not in m for m in config["target_modules"])



def test_peft_fuses_each_experts_adapters_exactly():
    """The fused expert adapters in PEFT's layout (ParamWrapper.get_delta_factors: A
    (E*R, in) -> (E, R, in), B (out, R*E) -> (out, R, E) -> (E, out, R)) give each expert's
    update B_e A_e: gate's and up's stacked for gate_up_proj, down's for down_proj, equal to
    the per-expert adapters' (random B, so the updates are not zero)."""
    from nnxscale.layers import lora
    from nnxscale.models import find_preset
    from nnxscale.training.export import peft_adapter, peft_tensors
    from nnxscale.training.model import lora_spec

    family, _ = find_preset("deepseek-test")
    config = SHRUNK["deepseek-test"]
    spec = lora_spec(nnxscale.TrainConfig.from_flags(model="deepseek-test", lora_rank=4, lora_targets="gate,up,down"), family, config)
    model = randomize(lora.attach(Decoder(config, rngs=nnx.Rngs(0)), spec, key=jax.random.key(0)), scale=0.2)
    fused = peft_adapter(model, family.lora, spec.rank, spec.alpha).tensors
    one_by_one, _ = peft_tensors(model, family.lora)
    p, E = "base_model.model.model.layers", config.num_local_experts
    for layer in (1, 2):
        for parts, wrapper in ((("gate_proj", "up_proj"), "base_layer."), (("down_proj",), "")):
            A = fused[f"{p}.{layer}.mlp.experts.{wrapper}lora_A.weight"]
            B = fused[f"{p}.{layer}.mlp.experts.{wrapper}lora_B.weight"]
            A, B = A.reshape(E, -1, A.shape[-1]), B.reshape(B.shape[0], -1, E).transpose(2, 0, 1)
            for e in range(E):
                want = np.concatenate([one_by_one[f"{p}.{layer}.mlp.experts.{e}.{part}.lora_B.weight"]
                                       @ one_by_one[f"{p}.{layer}.mlp.experts.{e}.{part}.lora_A.weight"] for part in parts])  # fmt: skip
                assert np.abs(want).max() > 0
                np.testing.assert_allclose(B[e] @ A[e], want, rtol=1e-5, atol=1e-6, err_msg=f"{layer} {parts} {e}")


def test_lora_target_q_adapts_latent_attentions_query():
    """``--lora-targets q`` (and the default targets, which hold it) on a model with latent
    attention: its q_a_proj and q_b_proj adapted, no error for the q_proj it does not have."""
    from nnxscale.layers import lora
    from nnxscale.models import find_preset
    from nnxscale.training.model import lora_spec

    family, _ = find_preset("deepseek-test")
    spec = lora_spec(nnxscale.TrainConfig.from_flags(model="deepseek-test", lora_rank=4, lora_targets="q"), family, SHRUNK["deepseek-test"])
    model = lora.attach(Decoder(SHRUNK["deepseek-test"], rngs=nnx.Rngs(0)), spec, key=jax.random.key(0))
    assert {p.rsplit(".", 1)[-1] for p, *_ in lora.adapted(model)} == {"q_a_proj", "q_b_proj"}


def test_one_dpo_step_on_qwen3(tmp_path):
    """qwen3 under --objective dpo: the first step's model is its reference (loss log 2)."""
    rows = [("Q: 2+2? A:", " 4", " 5"), ("Q: sky? A:", " blue", " green"), ("Q: 3*3? A:", " 9", " 6"), ("Q: cat? A:", " meow", " woof")]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in rows))
    cfg = tiny_cfg(tmp_path / "run", data, model="qwen3-test", mesh="data=8", steps=1, objective="dpo", dpo_beta=0.5,
                   data__batch_size=8, data__seq_len=24, data__val_fraction=0.0)  # fmt: skip
    nnxscale.train(cfg, progress=False, log=lambda _: None)
    (first,) = read_metrics(cfg.run_dir)
    assert first["loss"] == pytest.approx(np.log(2), rel=1e-6) and first["reward_margin"] == 0
