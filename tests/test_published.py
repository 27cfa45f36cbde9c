"""Planning published models and runs: a Hugging Face config.json alone, the registry of
published measured runs (bench/published_runs.json), XLA:CPU's calibrated figures."""

import json
import math
import re
from pathlib import Path

import pytest

from nnxscale.cli.commands import main


def test_plan_from_a_published_config_json_alone(tmp_path, capsys):
    """`plan --model DIR` where DIR holds a Hugging Face config.json and nothing else (no
    weights, no tokenizer), as published for Llama, Mixtral and GPT-2: the architecture is the
    config's; `train` refuses the same directory in one line (it needs the weights)."""
    C, L, N, K, H, F, V = 64, 2, 4, 2, 16, 96, 320
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": C,
             "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": N, "num_key_value_heads": K,
             "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "hidden_act": "silu"}  # fmt: skip
    layer = C * N * H + 2 * C * K * H + N * H * C + 3 * C * F + 2 * C
    configs = {
        "llama": (llama, V * C + L * layer + C + C * V),
        "mixtral": ({**llama, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
                    V * C + L * (layer + 3 * C * F * 3 + C * 4) + C + C * V),  # 4 experts' MLPs (one counted in layer) + router
        "gpt2": ({"model_type": "gpt2", "vocab_size": V, "n_positions": 128, "n_embd": C, "n_layer": L, "n_head": N},
                 V * C + 128 * C + L * (12 * C * C + 13 * C) + 2 * C),
    }  # fmt: skip
    for name, (hf, params) in configs.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(hf))
        assert main(["plan", "--model", str(d), "--mesh", "fsdp=8", "--batch-size", "8", "--seq-len", "32",
                     "--compile", "never", "--json"]) == 0  # fmt: skip
        plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert plan["num_params"] == params, (name, plan["num_params"], params)

    assert main(["train", "--model", str(tmp_path / "llama"), "--run-dir", str(tmp_path / "run"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "holds config.json but no weights" in err and "nnxscale plan works from config.json alone" in err, err
    assert not (tmp_path / "run").exists()  # refused before anything was written
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    assert main(["plan", "--model", str(tmp_path / "qwen"), "--mesh", "fsdp=8", "--compile", "never"]) == 2
    assert "model_type 'mamba', which no model family loads" in capsys.readouterr().err


REGISTRY = Path(__file__).parent.parent / "bench" / "published_runs.json"


def test_every_published_run_names_its_source_and_describes_a_plannable_run():
    """Each run of bench/published_runs.json: a model nnxscale builds (a preset or a shipped
    config.json), a target and a mesh of its chips, the batch the run's per-device batch makes,
    nnxscale's policy names, one published figure, and the repository, path, commit, date and
    quoted line it comes from."""
    from nnxscale.layers.remat import REMAT_NAMES
    from nnxscale.planning import targets
    from nnxscale.planning.hardware import CHIPS
    from nnxscale.training.model import model_architecture

    runs = json.loads(REGISTRY.read_text())["runs"]
    assert len({r["name"] for r in runs}) == len(runs) >= 7
    chips = set()
    for r in runs:
        model = str(REGISTRY.parent.parent / r["model"]) if r["model"].startswith("bench/") else r["model"]
        family, config = model_architecture(model)
        target = targets.get(r["target"])
        chips.add(target.chip)
        sizes = targets.mesh_sizes(r["mesh"], target)
        assert math.prod(sizes.values()) == target.chips, r["name"]
        assert r["batch_size"] == r["run"]["per_device_batch"] * target.chips * r["grad_accum"], r["name"]
        assert r["seq_len"] <= family.dims(config).context, r["name"]
        assert r["remat"] in REMAT_NAMES and r["dtype"] in ("float32", "bfloat16"), r["name"]
        (kind,) = [k for k in ("seconds_per_step", "tokens_per_s_per_device", "tflops_per_s_per_device") if k in r["published"]]
        assert r["published"][kind] > 0
        src = r["source"]
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", src["repo"]) and src["path"] and src["quote"], r["name"]
        assert re.fullmatch(r"[0-9a-f]{40}", src["commit"]) and re.fullmatch(r"\d{4}-\d{2}-\d{2}", src["date"]), r["name"]
        assert {"precision", "fp8", "attention", "remat_policy"} <= set(r["run"]), r["name"]
        if "run_hardware" in r:  # the run's own parts, as its authors describe them: a bandwidth, the peaks its clock lies between
            hw = r["run_hardware"]
            assert hw["hbm_bandwidth"] > 0 and hw["source"] and len(hw["bfloat16_peaks"]) >= 1, r["name"]
            assert all(0 < peak <= CHIPS[target.chip].peak_flops["bfloat16"] * 1.0001 for peak in hw["bfloat16_peaks"]), r["name"]
    assert {"h100", "v5e", "v5p", "v6e"} <= chips  # the runs: NVIDIA and the three TPU generations


def test_the_cpu_calibration_is_cached_per_jaxlib_and_core_count(tmp_path, monkeypatch):
    """XLA:CPU's figures are measured once per machine: read back while the jaxlib version and
    the core count are the same, measured again when either changes or when asked to; they are
    per device, so half the devices get twice the host's share each."""
    from nnxscale.planning import calibration

    calls = []

    def fake_measure():
        calls.append(1)
        return {"devices": 8, "matmul_flops": 1e9 * len(calls), "stream_bytes": 4e8, "op_seconds": 2e-5,
                "fresh_bytes": 3e8, "allreduce_bytes": 1e8, "allreduce_latency": 3e-4, "measured": "now"}  # fmt: skip

    path = tmp_path / "cal.json"
    first = calibration.host_figures(path=path, measure=fake_measure)
    assert calibration.host_figures(path=path, measure=fake_measure) == first and len(calls) == 1
    key = calibration.machine_key()
    monkeypatch.setattr(calibration, "machine_key", lambda: {**key, "cores": key["cores"] + 1})
    assert calibration.host_figures(path=path, measure=fake_measure)["matmul_flops"] == 2e9 and len(calls) == 2
    monkeypatch.setattr(calibration, "machine_key", lambda: {**key, "jaxlib": "0.0.1"})
    calibration.host_figures(path=path, measure=fake_measure)
    calibration.host_figures(path=path, measure=fake_measure, refresh=True)
    assert len(calls) == 4 and json.loads(path.read_text())["key"]["jaxlib"] == "0.0.1"

    eight, four = calibration.cpu_hardware(8, first), calibration.cpu_hardware(4, first)
    assert eight.peak("float32") == 1e9 and four.peak("float32") == 2e9 and four.op_overhead == 1e-5
    assert four.hbm_bandwidth == 2 * eight.hbm_bandwidth and four.links["cpu"].effective == 2e8
    assert four.fresh_memory_bandwidth == 2 * eight.fresh_memory_bandwidth == 6e8


def test_real_device_kinds_match_their_chips():
    """One table (sharding.devices.DEVICE_KINDS) says what a device is: the names JAX gives real
    devices (a v5p calls itself "TPU v5", a v5e "TPU v5 lite") match the right chip, whose
    figures the step-time prediction and the trainer's MFU both read; an unknown one (CPU) none."""
    from types import SimpleNamespace

    import numpy as np

    from nnxscale.planning import calibration
    from nnxscale.planning.hardware import CHIPS
    from nnxscale.sharding import devices

    for row in devices.DEVICE_KINDS:
        assert row.chip is None or row.bf16_peak == CHIPS[row.chip].peak("bfloat16"), row
    expected = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H100 PCIe": "h100", "NVIDIA H200": "h200",
                "NVIDIA A100-SXM4-80GB": "a100", "NVIDIA B200": "b200", "TPU v4": "v4", "TPU v5": "v5p",
                "TPU v5p": "v5p", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v6 lite": "v6e"}  # fmt: skip
    for kind, chip in expected.items():
        platform = "tpu" if kind.startswith("TPU") else "gpu"
        device = SimpleNamespace(platform=platform, device_kind=kind)
        assert devices.device_kind(kind).chip == chip, kind
        assert devices.peak_flops(device) == CHIPS[chip].peak("bfloat16"), kind
        assert calibration.local_hardware(SimpleNamespace(devices=np.array([device]))) is CHIPS[chip], kind
    cpu = SimpleNamespace(platform="cpu", device_kind="cpu")
    assert devices.device_kind("cpu") is None and devices.peak_flops(cpu) is None
    for kind, peak in (("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12), ("NVIDIA L40", 181e12)):  # Ada: each its own
        ada = SimpleNamespace(platform="gpu", device_kind=kind)  # an MFU, but no figures for a prediction
        assert devices.peak_flops(ada) == peak, kind
        assert calibration.local_hardware(SimpleNamespace(devices=np.array([ada]))) is None, kind


def test_a_cpu_run_never_predicts_even_once_this_machine_is_calibrated(tmp_path, monkeypatch):
    """The trainer asks local_hardware for its devices' figures: none on XLA:CPU, calibrated or
    not (the figures move with the host's load; bench/steptime.py measures them around its steps)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from nnxscale.planning import calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    assert calibration.local_hardware(mesh) is None
    figures = {"devices": 8, "matmul_flops": 1e9, "stream_bytes": 4e8, "op_seconds": 2e-5, "allreduce_bytes": 1e8,
               "allreduce_latency": 3e-4, "measured": "now"}  # fmt: skip
    calibration.host_figures(measure=lambda: figures)
    assert calibration.cache_path().is_file() and str(calibration.cache_path()).startswith(str(tmp_path))
    assert calibration.local_hardware(mesh) is None
    assert calibration.cpu_hardware(4, figures).peak("float32") == 2e9  # what bench/steptime.py uses: 8 devices' share, for 4
