"""The quantized frozen base (QLoRA, issue 50): NF4 and int8 in blocks, read back where a layer
reads its weight, sharded like the weight."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from scipy.stats import norm

from nnxscale.errors import ConfigError
from nnxscale.layers import lora, quantize


def nf4_codebook() -> np.ndarray:
    """NF4's 16 values as the QLoRA paper defines them (Appendix E): quantiles of N(0, 1),
    8 positive and 7 negative, with an exact zero, normalized to [-1, 1]."""
    offset = 0.9677083
    positive = norm.ppf(np.linspace(offset, 0.5, 9)[:-1])
    negative = -norm.ppf(np.linspace(offset, 0.5, 8)[:-1])
    values = np.sort(np.concatenate([positive, [0.0], negative]))
    return values / values.max()


def by_hand(w: np.ndarray, block: int, codebook: np.ndarray) -> np.ndarray:
    """``w (in, out)`` quantized and read back per block of ``block`` inputs of each output:
    absmax scale, nearest code."""
    out = np.empty_like(w)
    for start in range(0, w.shape[0], block):
        part = w[start : start + block]
        scale = np.abs(part).max(axis=0, keepdims=True)
        nearest = np.abs(part[..., None] / scale[..., None] - codebook).argmin(-1)
        out[start : start + block] = codebook[nearest] * scale
    return out


def test_nf4_is_the_qlora_papers_code_in_blocks_of_64():
    w = np.asarray(jax.random.normal(jax.random.key(0), (256, 96)), np.float32) * 0.02
    q = quantize.quantize(jnp.asarray(w), "nf4", axis=0)
    assert q.codes.dtype == jnp.uint4 and q.codes.shape == (256, 96)
    assert q.scales.shape == (4, 96) and q.scales.dtype == jnp.float32  # one scale per 64 inputs of each output
    np.testing.assert_allclose(np.asarray(q[...]), by_hand(w, 64, nf4_codebook()), rtol=2e-6, atol=1e-9)
    assert 0.05 < quantize.error(jnp.asarray(w), q) < 0.12  # NF4 on normal weights: about 9%


def test_int8_blocks_and_the_read_dtype():
    w = jax.random.normal(jax.random.key(1), (2, 128, 48))  # stacked: 2 layers of (128 in, 48 out)
    q = quantize.quantize(w, "int8", axis=1, dtype=jnp.bfloat16)
    assert q.codes.dtype == jnp.int8 and q.scales.shape == (2, 2, 48)
    assert q[...].dtype == jnp.bfloat16 and q.shape == w.shape
    assert quantize.error(w, q) < 0.01
    np.testing.assert_allclose(np.asarray(q[0]), np.asarray(q[...][0]))  # an index reads that part of it
    # a dimension 64 does not divide takes the largest block that divides it
    assert quantize.quantize(jnp.ones((48, 8)), "nf4", axis=0).scales.shape == (3, 8)


def test_an_unknown_scheme_is_one_clear_error():
    with pytest.raises(ConfigError, match="--quantize-base 'fp4': choose one of nf4, int8"):
        quantize.quantize(jnp.ones((64, 4)), "fp4", axis=0)


def test_layers_read_a_quantized_weight_dequantized():
    """An ``nnx.Linear`` and an ``nnx.Einsum`` whose kernel holds a :class:`Quantized` compute
    with the dequantized weight, in their compute dtype."""
    linear = nnx.Linear(128, 32, rngs=nnx.Rngs(0))
    einsum = nnx.Einsum("btc,cnh->btnh", (128, 4, 8), rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (2, 3, 128))
    for layer, axis in ((linear, 0), (einsum, 0)):
        q = quantize.quantize(layer.kernel[...], "nf4", axis=axis)
        want = layer(x) - (0 if layer is einsum else layer.bias[...])  # without the bias: compared below
        layer.kernel.set_value(q)
        got = layer(x) - (0 if layer is einsum else layer.bias[...])
        dequantized = jnp.einsum("btc,c...->bt...", x, q.dequantize())
        np.testing.assert_allclose(np.asarray(got), np.asarray(dequantized), rtol=1e-5, atol=1e-5)
        assert 0 < float(jnp.abs(got - want).max())  # not the full-precision weight


def test_codes_and_scales_are_sharded_like_the_weight():
    mesh = jax.make_mesh((2, 4), ("fsdp", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    w = jax.device_put(jax.random.normal(jax.random.key(3), (2, 256, 64)), NamedSharding(mesh, P(None, "fsdp", "model")))
    q = quantize.quantize_params({"w": w}, {("w",): (1, 1)}, "nf4")["w"]
    assert q.codes.sharding.spec == P(None, "fsdp", "model")
    assert {s.data.shape for s in q.codes.addressable_shards} == {(2, 128, 16)}
    assert {s.data.shape for s in q.scales.addressable_shards} == {(2, 2, 16)}  # 4 blocks of 64 over fsdp=2
    small = jax.device_put(jnp.ones((2, 64, 64)), NamedSharding(mesh, P(None, "fsdp", "model")))
    q = quantize.quantize_params({"w": small}, {("w",): (1, 1)}, "int8")["w"]
    assert q.scales.shape == (2, 1, 64) and q.scales.sharding.spec == P(None, None, "model")  # 1 block: whole
    abstract = jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding)
    a = quantize.quantize_abstract({"w": abstract}, {("w",): (1, 1)}, "nf4")["w"]
    assert a.codes.shape == w.shape and a.scales.shape == (2, 4, 64) and a.scales.sharding.spec == P(None, "fsdp", "model")


def test_the_stacked_weights_are_the_layers_linear_weights():
    """``stacked_weights``: every linear weight of the stacked layers (attention and MLP
    projections), not the embedding, the norms or the head."""
    from nnxscale.models import llama

    model = llama.Llama(llama.preset("llama-mini"), rngs=nnx.Rngs(0))
    targets = lora.stacked_weights(model)
    names = {".".join(map(str, p)) for p in targets}
    assert names and all(n.startswith("layers.") and n.endswith(".kernel") for n in names), names
    assert {n.split(".")[-2] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def hf_llama(tmp_path):
    """A small Llama (2 layers, 128 wide: whole blocks of 64) in Hugging Face's layout."""
    from nnxscale.models import llama

    config = llama.preset("llama-tiny", vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                          num_key_value_heads=4, head_dim=32, num_hidden_layers=2, tie_word_embeddings=False)  # fmt: skip
    llama.save_pretrained(llama.Llama(config, rngs=nnx.Rngs(3)), tmp_path / "llama-hf")
    return tmp_path / "llama-hf"


def test_qlora_trains_an_imported_llama_close_to_lora_over_its_bfloat16_base(tmp_path, text_data):
    """A Llama in Hugging Face's layout, fine-tuned with rank-8 adapters on fsdp=2,model=4 in
    bfloat16: over its base stored NF4 the first loss is within 2% of the same LoRA's over the
    bfloat16 base (not equal: the base really is quantized), the loss falls, and the
    quantization error is logged once, at the start."""
    from test_train import quiet_train, tiny_cfg

    from nnxscale.training.rundir import read_metrics

    hf = hf_llama(tmp_path)

    def run(name, **kw):
        logs = []
        cfg = tiny_cfg(tmp_path / name, text_data, model=str(hf), mesh="fsdp=2,model=4", steps=4, lora__rank=8,
                       model__dtype="bfloat16", optim__lr=3e-2, optim__warmup_steps=0, **kw)  # fmt: skip
        quiet_train(cfg, logs.append)
        return [r["loss"] for r in read_metrics(tmp_path / name)], logs

    lora_losses, _ = run("lora")
    qlora_losses, logs = run("qlora", lora__quantize_base="nf4")
    assert qlora_losses[0] != lora_losses[0]
    assert abs(qlora_losses[0] / lora_losses[0] - 1) < 0.02, (qlora_losses, lora_losses)
    assert qlora_losses[-1] < qlora_losses[0], qlora_losses
    quantized = [line for line in logs if line.startswith("quantized base:")]
    assert len(quantized) == 1 and "7 weights stored nf4" in quantized[0], logs  # 7 projections, each stacked over 2 layers
    assert any("stacked linear weights stored nf4" in line for line in logs), logs


def test_a_qlora_run_resumes_exactly_samples_and_exports(tmp_path, text_data, capsys):
    """From the command line: a QLoRA run saved at step 2 and resumed to 4 logs the losses of
    one that never stopped (the base quantized again the same way from its source, as its
    config.json records); it samples; ``export --merged`` writes the dequantized base with the
    adapters folded in (each layer weight NF4's error away from the source's), ``--peft`` the
    adapters alone."""
    import json

    from test_cli import run_main
    from safetensors.numpy import load_file

    from nnxscale.training.rundir import read_metrics

    hf = hf_llama(tmp_path)

    def train(name, steps, *extra):
        args = ["train", "--model", str(hf), "--data", str(text_data), "--run-dir", str(tmp_path / name), "--mesh",
                "fsdp=2,model=4", "--batch-size", "16", "--seq-len", "32", "--lora-rank", "8", "--quantize-base", "nf4",
                "--dtype", "bfloat16", "--lr", "1e-2", "--warmup-steps", "0", "--min-lr-ratio", "1", "--log-every", "1",
                "--eval-every", "0",
                "--steps", str(steps), *extra]  # fmt: skip
        code, out, err = run_main(capsys, args)
        assert code == 0, err
        return out

    train("whole", 4, "--save-every", "0")
    train("stopped", 2, "--save-every", "2")
    assert "resumed" in train("stopped", 4, "--save-every", "2")
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "stopped")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
    recorded = json.loads((tmp_path / "stopped" / "config.json").read_text())
    assert recorded["train"]["lora"]["quantize_base"] == "nf4"

    code, out, err = run_main(capsys, ["sample", "--run-dir", str(tmp_path / "stopped"), "--prompt", "def ", "--max-new-tokens", "8"])
    assert code == 0, err
    code, _, err = run_main(capsys, ["export", "--run-dir", str(tmp_path / "stopped"), "--merged", str(tmp_path / "merged"),
                                     "--peft", str(tmp_path / "peft")])  # fmt: skip
    assert code == 0, err
    source, merged = load_file(hf / "model.safetensors"), load_file(tmp_path / "merged" / "model.safetensors")
    adapters = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert source.keys() == merged.keys()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        w, m = source[name].astype(np.float32), merged[name].astype(np.float32)  # (out, in): blocks along in
        peft = f"base_model.model.{name[: -len('.weight')]}"
        delta = adapters[f"{peft}.lora_B.weight"] @ adapters[f"{peft}.lora_A.weight"]  # alpha = rank: scale 1
        # each weight is quantized as it is read, from the checkpoint's float32
        dequantized = np.asarray(quantize.quantize(jnp.asarray(w), "nf4", axis=1).dequantize())
        assert np.linalg.norm(m - (dequantized + delta)) / np.linalg.norm(m) < 0.01, name  # bfloat16's rounding
        assert np.linalg.norm(m - (w + delta)) / np.linalg.norm(m) > 0.05, name  # the base exported is the quantized one
    embed = "model.embed_tokens.weight"  # not quantized: the source's, in the compute dtype
    np.testing.assert_array_equal(merged[embed].astype(np.float32), source[embed].astype(jnp.bfloat16).astype(np.float32))


def test_plan_counts_the_base_in_its_codes():
    """``plan`` of a QLoRA run compiles the step over the quantized base: llama-mini on fsdp=8
    with float32 compute, its stacked weights in 4-bit codes and a float32 scale per 64 entries
    instead of 32 bits each; the layout's parameter bytes and the compiler's peak drop."""
    import nnxscale
    from test_train import tiny_cfg

    def planned(**kw):
        return nnxscale.plan(tiny_cfg("unused", "unused", model="llama-mini", mesh="fsdp=8", lora__rank=4, **kw))

    lora, qlora = planned(), planned(lora__quantize_base="nf4")
    config = __import__("nnxscale.models.llama", fromlist=["preset"]).preset("llama-mini")
    C, F, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * config.head_size
    stacked = L * (2 * C * C + 2 * C * kv + 3 * C * F)  # q, o; k, v; gate, up, down
    codes = stacked * (4 - 0.5) / 8  # float32 weights to 4-bit codes, bytes per device on fsdp=8
    scales = stacked / 64 * 4  # all of them: a scale's block axis may be too short to split (3 blocks of 192)
    saved = lora.param_bytes - qlora.param_bytes
    assert codes - scales <= saved <= codes - scales / 8, (saved, codes, scales)
    # The compiler's peak drops by less at this size: each layer's gathered weight is dequantized
    # into a temporary (llama-3.1-70b on one H100: 140.9 GiB -> 50.6, docs/quantization.md).
    assert qlora.peak_bytes < lora.peak_bytes - saved / 5, (qlora.peak_bytes, lora.peak_bytes, saved)


def test_each_weight_is_quantized_as_it_is_read(tmp_path, monkeypatch):
    """From a Hugging Face directory the base never reaches the devices whole in full
    precision, nor does one stacked weight: each layer of a stacked weight is quantized
    right after its own tensor is read, before the next layer's is; the layers are then
    joined into the stacked weight's codes and scales."""
    from test_train import tiny_cfg

    from nnxscale.models.common import hf_checkpoint
    from nnxscale.training.state import load_init_params, setup

    hf = hf_llama(tmp_path)
    s = setup(tiny_cfg("unused", "unused", model=str(hf), mesh="fsdp=2,model=4", lora__rank=4, lora__quantize_base="nf4"))
    events = []
    read, quantized = hf_checkpoint.HFLayout.read, quantize.Quantizer.__call__

    def reading(self, sliced, index):
        events.append(("read", None))
        return read(self, sliced, index)

    def quantizing(self, path, w):
        q = quantized(self, path, w)
        if q is not w:
            events.append(("quantized", (path, w.shape)))
        return q

    monkeypatch.setattr(hf_checkpoint.HFLayout, "read", reading)
    monkeypatch.setattr(quantize.Quantizer, "__call__", quantizing)
    params = load_init_params(s, str(hf), warn=lambda _: None)
    done = [i for i, (kind, _) in enumerate(events) if kind == "quantized"]
    assert len(done) == 7 * 2  # 7 projections, each stacked over 2 layers: one layer at a time
    for i in done:  # one layer's weight: the stacked codes' shape without the layer axis
        path, shape = events[i][1]
        stacked = params
        for k in path:
            stacked = stacked[k]
        assert shape == stacked.codes.shape[1:], (path, shape)
    for before, after in zip(done, done[1:]):  # the next layer's tensor read between two quantizations
        assert any(kind == "read" for kind, _ in events[before + 1 : after]), events
    up = params["layers"]["mlp"]["up_proj"]["kernel"]
    assert up.codes.shape == (2, 128, 256) and up.scales.shape == (2, 2, 256)
    assert quantize.is_quantized(params["layers"]["mlp"]["up_proj"]["kernel"])
