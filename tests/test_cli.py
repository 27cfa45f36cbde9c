"""The command line on bad input: one clear line on stderr, a non-zero exit, no traceback,
and nothing already saved in the run directory lost. Plus ``plan`` and ``train --help``."""

import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fault_injection import flip_bytes

from nnxscale.checkpoint.checkpointer import checkpoint_dir
from nnxscale.cli.commands import main


def train_args(run_dir, data, *extra) -> list[str]:
    """A small valid ``train`` command; flags in ``extra`` override (argparse: last wins).

    Its schedule is test_train's pinned one (2 warmup steps, then constant), so its step is
    the same program as test_train's data=8 runs: compiled once for both.
    """
    return [
        "train", "--model", "gpt2-tiny", "--mesh", "data=8", "--batch-size", "16", "--seq-len", "32",
        "--steps", "4", "--save-every", "2", "--eval-every", "0", "--warmup-steps", "2", "--min-lr-ratio", "1.0",
        "--data", str(data), "--run-dir", str(run_dir), "--no-progress", *extra,
    ]  # fmt: skip


def snapshot(directory) -> dict:
    """Every file under ``directory`` with a hash of its bytes."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def assert_one_error_line(code, err, *words):
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("nnxscale: error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])


def run_main(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, text_data):
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    assert main(train_args(run_dir, text_data)) == 0
    assert sorted(p.name for p in checkpoint_dir(run_dir).iterdir()) == ["2", "4"]
    return run_dir


# --------------------------------------------------------------------------------------
# bad input on a fresh run directory
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--model", "gpt2-huge"], ["'gpt2-huge'", "gpt2-tiny"]),
        (["--rules", "zero3"], ["'zero3'", "fsdp"]),
        (["--mesh", "data=3"], ["data=3", "3 devices", "8"]),
        (["--mesh", "data:8"], ["data:8"]),
        (["--batch-size", "12"], ["--batch-size 12", "multiple of 8", "data=8"]),
        (["--batch-size", "12", "--mesh", "data=2,model=4", "--grad-accum", "4"], ["--batch-size 12", "multiple of 8"]),
        (["--seq-len", "256"], ["--seq-len 256", "128"]),
    ],
    ids=["unknown-model", "unknown-rules", "mesh-too-big", "mesh-malformed", "batch-indivisible",
         "batch-indivisible-accum", "seq-len-too-long"],  # fmt: skip
)
def test_bad_settings_fail_with_one_line(tmp_path, text_data, capsys, extra, words):
    code, _, err = run_main(capsys, train_args(tmp_path / "run", text_data, *extra))
    assert_one_error_line(code, err, *words)


def test_a_document_mask_needs_a_separator_and_a_family_loss(tmp_path, capsys):
    """A token file does not say which token ends a document; your own module or loss
    decides its own masks. One line each, nothing written."""
    import numpy as np
    from flax import nnx

    from nnxscale import TrainConfig
    from nnxscale.errors import ConfigError
    from nnxscale.training.config import with_overrides
    from nnxscale.training.model import run_model

    data = tmp_path / "tokens.npy"
    np.save(data, np.arange(20_000, dtype=np.int32) % 256)
    code, _, err = run_main(capsys, train_args(tmp_path / "run", data, "--document-mask"))
    assert_one_error_line(code, err, "--document-mask", "tokens.npy", "--tokenizer")
    assert not (tmp_path / "run").exists()
    cfg = with_overrides(TrainConfig(), {"data.document_mask": True})
    with pytest.raises(ConfigError, match="--document-mask.*your own module or loss"):
        run_model(cfg, model=lambda rngs: nnx.Linear(2, 2, rngs=rngs), separator=0)


# Every setting, from a flag: what it must be. Each of these ran (or crashed) before.
BAD_FLAGS = [
    (["--lr", "inf"], ["--lr (optim.lr)", "finite", "inf"]),
    (["--lr", "nan"], ["--lr (optim.lr)", "finite", "nan"]),
    (["--lr", "-0.001"], ["--lr (optim.lr)", "positive", "-0.001"]),
    (["--min-lr-ratio", "-0.5"], ["--min-lr-ratio (optim.min_lr_ratio)", "[0, 1]", "-0.5"]),
    (["--min-lr-ratio", "1.5"], ["--min-lr-ratio (optim.min_lr_ratio)", "[0, 1]", "1.5"]),
    (["--warmup-steps", "-1"], ["--warmup-steps (optim.warmup_steps)", "at least 0", "-1"]),
    (["--weight-decay", "-0.1"], ["--weight-decay (optim.weight_decay)", "-0.1"]),
    (["--decay-steps", "0"], ["--decay-steps (optim.decay_steps)", "0"]),
    (["--grad-clip", "-1"], ["--grad-clip (optim.grad_clip)", "-1"]),
    (["--grad-accum", "0"], ["--grad-accum (optim.grad_accum)", "at least 1"]),
    (["--beta1", "1"], ["--beta1 (optim.beta1)", "[0, 1)"]),
    (["--beta2", "-0.5"], ["--beta2 (optim.beta2)", "[0, 1)"]),
    (["--dropout", "1"], ["--dropout", "[0, 1)"]),
    (["--val-fraction", "1"], ["--val-fraction (data.val_fraction)", "[0, 1)"]),
    (["--eval-batches", "0"], ["--eval-batches (data.eval_batches)", "at least 1"]),
    (["--steps", "0"], ["--steps", "0"]),
    (["--steps", "2147483648"], ["--steps", "2147483647"]),
    (["--steps", "ten"], ["--steps", "'ten'"]),
    (["--steps", "10.5"], ["--steps", "'10.5'"]),
    (["--seed", "-1"], ["--seed", "-1"]),
    (["--seed", "4294967296"], ["--seed", "4294967295"]),  # jax.random.key(2**32) is key(0) again
    (["--keep", "0"], ["--keep", "at least 1"]),
    (["--max-bad-steps", "0"], ["--max-bad-steps", "at least 1"]),
    (["--save-every", "-1"], ["--save-every", "-1"]),
    (["--eval-every", "-2"], ["--eval-every", "-2"]),
    (["--log-every", "0"], ["--log-every", "at least 1"]),
    (["--dtype", "float16"], ["--dtype", "'float16'"]),
    (["--run-dir", " "], ["--run-dir", "empty"]),
    (["--profile-steps", "5:2"], ["--profile-steps '5:2'", "1 <= A <= B"]),
    (["--profile-steps", "ten"], ["--profile-steps 'ten'", "A:B"]),
    (["--cpu-devices", "0"], ["--cpu-devices", "0"]),
    (["--cpu-devices", "100000"], ["--cpu-devices", "1024", "100000"]),
    (["--quantize-base", "nf4"], ["--quantize-base nf4", "--lora-rank"]),
    (["--quantize-base", "fp4", "--lora-rank", "4"], ["--quantize-base", "'fp4'", "'nf4', 'int8'"]),
]

# Every setting, from a config file: the field is named, with the file.
BAD_CONFIG_FILES = [
    ("run.toml", 'steps = "ten"\n', ["run.toml", "--steps", "whole number", "'ten'"]),
    ("run.toml", "steps = 10.5\n", ["run.toml", "--steps", "whole number", "10.5"]),
    ("run.toml", "steps = 1e400\n", ["run.toml", "--steps", "whole number", "inf"]),
    ("run.toml", "[optim]\nlr = inf\n", ["run.toml", "--lr (optim.lr)", "finite"]),
    ("run.toml", "[optim]\nmin_lr_ratio = -0.5\n", ["--min-lr-ratio (optim.min_lr_ratio)", "[0, 1]"]),
    ("run.toml", '[model]\nremat = "yes"\n', ["--remat", "none, full, dots, dots-except-mlp-in", "'yes'"]),
    ("run.toml", "[model]\nremat = 3\n", ["run.toml", "--remat", "a string", "3"]),
    ("run.toml", "optim = 3\n", ["run.toml", "[optim]", "table"]),
    ("run.toml", "steps = \n", ["run.toml", "not valid TOML"]),
    ("run.json", '{"data": {"batch_size": null}}', ["run.json", "--batch-size (data.batch_size)", "None"]),
    ("run.json", '{"seed": true}', ["run.json", "--seed", "whole number", "True"]),
    ("run.toml", '[lora]\nrank = 4\nquantize_base = "nf3"\n', ["--quantize-base", "nf4, int8", "'nf3'"]),
]


@pytest.mark.parametrize("extra, words", BAD_FLAGS, ids=[" ".join(e) for e, _ in BAD_FLAGS])
def test_every_setting_is_validated_from_flags(tmp_path, text_data, capsys, extra, words):
    code, _, err = run_main(capsys, train_args(tmp_path / "run", text_data, *extra))
    assert_one_error_line(code, err, *words)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, text, words", BAD_CONFIG_FILES, ids=[t.strip() for _, t, _ in BAD_CONFIG_FILES])
def test_every_setting_is_validated_from_config_files(tmp_path, text_data, capsys, name, text, words):
    config = tmp_path / name
    config.write_text(text)
    argv = ["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--data", str(text_data)]
    code, _, err = run_main(capsys, argv)
    assert_one_error_line(code, err, *words)
    assert not (tmp_path / "run").exists()


def test_a_bad_cpu_device_count_in_the_environment(tmp_path, capsys, monkeypatch):
    for value, words in (("abc", ["NNXSCALE_CPU_DEVICES='abc'"]), ("-3", ["NNXSCALE_CPU_DEVICES", "-3"])):
        monkeypatch.setenv("NNXSCALE_CPU_DEVICES", value)
        code, _, err = run_main(capsys, ["plan", "--model", "gpt2-tiny"])
        assert_one_error_line(code, err, *words)


@pytest.mark.parametrize(
    "content", [b"{not json", b"\x89PNG\r\n\x1a\n\x00\xff", b'{"train": {"steps": "ten"}}', b"[1, 2]"],
    ids=["not-json", "binary", "wrong-type", "not-a-config"],
)
def test_a_corrupt_config_json_names_the_file(saved_run, text_data, tmp_path, capsys, content):
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    (run_dir / "config.json").write_bytes(content)
    before = snapshot(run_dir)
    for argv in (train_args(run_dir, text_data), ["sample", "--run-dir", str(run_dir)]):
        code, _, err = run_main(capsys, argv)
        assert_one_error_line(code, err, str(run_dir / "config.json"))
    assert snapshot(run_dir) == before


def test_missing_data_path(tmp_path, capsys):
    missing = tmp_path / "no" / "such.txt"
    code, _, err = run_main(capsys, train_args(tmp_path / "run", missing))
    assert_one_error_line(code, err, str(missing), "does not exist")


def test_empty_data_file(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, _, err = run_main(capsys, train_args(tmp_path / "run", empty))
    assert_one_error_line(code, err, str(empty), "empty")


# --------------------------------------------------------------------------------------
# bad input on a run directory that holds a run: nothing in it is lost
# --------------------------------------------------------------------------------------


def test_conflicting_config_names_the_fields_and_keeps_the_run(saved_run, text_data, capsys):
    before = snapshot(saved_run)
    code, _, err = run_main(capsys, train_args(saved_run, text_data, "--seed", "1", "--lr", "0.01"))
    assert_one_error_line(code, err, str(saved_run), "seed", "optim.lr", "0.01")
    assert "data.seq_len" not in err  # unchanged fields are not listed
    assert snapshot(saved_run) == before


@pytest.mark.parametrize(
    "extra, words",
    [(["--mesh", "data=3"], ["data=3"]), (["--rules", "zero3"], ["'zero3'"])],
    ids=["mesh", "rules"],
)
def test_bad_resume_settings_keep_the_run(saved_run, text_data, capsys, extra, words):
    before = snapshot(saved_run)
    code, _, err = run_main(capsys, train_args(saved_run, text_data, "--steps", "6", *extra))
    assert_one_error_line(code, err, *words)
    assert snapshot(saved_run) == before


# A chunk that no longer decompresses makes Orbax abandon its other reads, whose coroutines
# Python reports as "exception ignored" once they are garbage collected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_checkpoint_without_checksums_or_data_fingerprint_restores_with_a_warning(saved_run, text_data, tmp_path, capsys):
    """As saved by an nnxscale that recorded neither: the run resumes, and says what it could
    not check (a line each, naming the step), instead of trusting it silently."""
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    step = checkpoint_dir(run_dir) / "4"
    shutil.rmtree(step / "checksums")
    extras = step / "extras" / "metadata"
    extras.write_text(json.dumps({k: v for k, v in json.loads(extras.read_text()).items() if k != "data_fingerprint"}))
    code, out, err = run_main(capsys, train_args(run_dir, text_data, "--steps", "5"))
    assert code == 0, err
    assert f"warning: checkpoint step 4 at {step} has no checksums (saved before nnxscale recorded them): " \
           "restored unverified" in out, out  # fmt: skip
    assert "warning: checkpoint step 4 records no data fingerprint" in out, out
    assert "resumed" in out and "from step 4" in out, out
    # the closing line names what the run directory holds, TensorBoard's events included
    assert out.splitlines()[-1].endswith(f"Run directory: {run_dir} (metrics.jsonl, loss.png, checkpoints/, tensorboard/)"), out


# Python reports the damaged step's abandoned reads as "exception ignored" when they are
# garbage collected; the command holds them back (test_process), pytest's own hook sees them.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(saved_run, text_data, tmp_path, capsys):
    """Flipped bytes in step 4's data files: sample (which reads the parameters only) and
    train warn and use step 2; train sets step 4 aside and trains on; with every step
    damaged, train refuses in one line and touches nothing."""
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    root = checkpoint_dir(run_dir)
    flip_bytes(root / "4", every=True)

    code, out, err = run_main(capsys, ["sample", "--run-dir", str(run_dir), "--prompt", "def ", "--max-new-tokens", "8"])
    assert code == 0, err
    assert out.startswith("def ")
    assert f"checkpoint step 4 at {root / '4'} is damaged" in err and "using step 2" in err, err

    code, out, err = run_main(capsys, train_args(run_dir, text_data, "--steps", "6"))
    assert code == 0, err
    # Orbax either fails to read it (a compressed chunk) or reads garbage that fails its checksum.
    assert f"checkpoint step 4 at {root / '4'} is damaged" in out and f"moved it to {root / '4.damaged'}" in out, out
    assert f"resumed {run_dir} from step 2" in out
    assert sorted(p.name for p in root.iterdir()) == ["2", "4", "4.damaged", "6"]

    for step in ("2", "4", "6"):
        flip_bytes(root / step)
    before = snapshot(run_dir)
    env = {k: v for k, v in os.environ.items() if k != "NNXSCALE_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "nnxscale", *train_args(run_dir, text_data, "--steps", "8")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert_one_error_line(proc.returncode, proc.stderr, f"every checkpoint in {root} is damaged (steps 2, 4, 6")
    assert snapshot(run_dir) == before  # refused: nothing renamed, deleted or rewritten
    gc.collect()  # the ignored exceptions surface here, under this test's filter


def test_sample_decodes_a_batch_of_prompts_on_the_runs_mesh(saved_run, tmp_path, capsys):
    """--prompt twice and --prompts-file: one batch, a block per prompt; greedy text is the
    same decoded alone, in a batch, from Python, and recomputed without the cache."""
    from nnxscale.training.sampling import sample

    (tmp_path / "prompts.txt").write_text("class \n\nimport os\n")
    argv = ["sample", "--run-dir", str(saved_run), "--prompt", "def ", "--prompt", "x = ", "--prompts-file",
            str(tmp_path / "prompts.txt"), "--max-new-tokens", "12", "--temperature", "0"]  # fmt: skip
    code, out, err = run_main(capsys, argv)
    assert code == 0 and err == "", err
    prompts = ["def ", "x = ", "class ", "import os"]
    texts = sample(saved_run, prompts, max_new_tokens=12, temperature=0)
    assert out == "".join(f"--- {i + 1} of 4 ---\n{t}\n" for i, t in enumerate(texts))
    assert all(t.startswith(p) and len(t) > len(p) for t, p in zip(texts, prompts))
    assert sample(saved_run, "x = ", max_new_tokens=12, temperature=0) == texts[1]
    code, again, err = run_main(capsys, [*argv, "--no-cache", "--mesh", "model=2,data=4"])
    assert code == 0 and again == out, err


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--top-p", "1.5"], ["--top-p", "(0, 1]", "1.5"]),
        (["--temperature", "-1"], ["--temperature", "-1.0"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens", "0"]),
        (["--prompts-file", "no-such-file.txt"], ["--prompts-file no-such-file.txt", "cannot read"]),
        (["--mesh", "data=3"], ["data=3", "8"]),
    ],
)
def test_sample_refuses_bad_options_in_one_line(saved_run, capsys, extra, words):
    code, _, err = run_main(capsys, ["sample", "--run-dir", str(saved_run), "--prompt", "def ", *extra])
    assert_one_error_line(code, err, *words)


def test_init_refuses_a_run_directory_with_checkpoints(saved_run, capsys):
    before = snapshot(saved_run)
    code, _, err = run_main(capsys, ["init", "--model", "gpt2-tiny", "--mesh", "fsdp=8", "--run-dir", str(saved_run)])
    assert_one_error_line(code, err, str(saved_run), "already holds checkpoints")
    assert snapshot(saved_run) == before


# --------------------------------------------------------------------------------------
# plan and help
# --------------------------------------------------------------------------------------


def test_plan_prints_the_sharding_table(capsys):
    code, out, err = run_main(capsys, ["plan", "--model", "gpt2", "--mesh", "data=2,model=4", "--compile", "never", "--table"])
    assert code == 0, err
    assert "total: 124,439,808 parameters" in out
    rows = out.splitlines()
    assert any(r.split()[:2] == ["path", "shape"] for r in rows)
    wte = next(r for r in rows if r.startswith("wte.embedding"))
    assert "(50257, 768)" in wte and "data=2,model=4" in out
    assert "peak" in out and "estimate" in out  # the step plan comes first


def test_train_help_documents_the_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--mesh", "--rules", "--steps", "--batch-size", "--seq-len", "--data",
                 "--run-dir", "--seed", "--save-every", "--log-every"):  # fmt: skip
        assert f"  {flag} " in out, flag


# --------------------------------------------------------------------------------------
# config files
# --------------------------------------------------------------------------------------


def test_config_file_sets_fields_and_flags_override_it(tmp_path, text_data, capsys):
    config = tmp_path / "run.toml"
    config.write_text(
        "steps = 3\n[model]\nname = \"gpt2-tiny\"\n[parallel]\nmesh = \"fsdp=8\"\nmin_shard_bytes = 0\n"
        "[optim]\nwarmup_steps = 2\nmin_lr_ratio = 1.0\n"  # test_train's fsdp=8 run: one compiled step for both
        "[data]\nseq_len = 32\nbatch_size = 16\n"
    )
    run_dir = tmp_path / "run"
    argv = ["train", "--config", str(config), "--steps", "2", "--data", str(text_data),
            "--run-dir", str(run_dir), "--eval-every", "0", "--no-progress"]  # fmt: skip
    code, out, err = run_main(capsys, argv)
    assert code == 0, err
    saved = json.loads((run_dir / "config.json").read_text())["train"]
    assert saved["parallel"]["mesh"] == "fsdp=8" and saved["optim"]["warmup_steps"] == 2 and saved["data"]["seq_len"] == 32
    assert saved["optim"]["min_lr_ratio"] == 1.0 and saved["parallel"]["min_shard_bytes"] == 0
    assert not err.strip(), err  # sections: no deprecation line
    assert saved["steps"] == 2  # the flag wins over the file
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [2]


def test_flat_names_of_0_1_still_work_with_one_deprecation_line(tmp_path, capsys):
    """Config files written for 0.1 (flat ``model``, ``mesh``, ``remat``) give the same config,
    with one line naming each name's new place; ``TrainConfig(mesh=...)`` warns and works."""
    from nnxscale.cli.commands import _config, build_parser
    from nnxscale.training.config import TrainConfig, config_conflicts, with_overrides

    flat, sections = tmp_path / "flat.toml", tmp_path / "sections.toml"
    flat.write_text('model = "gpt2-tiny"\nmesh = "fsdp=8"\nremat = true\nsave_every = 7\n[optim]\nlr = 0.01\n')
    sections.write_text('[model]\nname = "gpt2-tiny"\nremat = "full"\n[parallel]\nmesh = "fsdp=8"\n'
                        '[checkpoint]\nsave_every = 7\n[optim]\nlr = 0.01\n')  # fmt: skip
    parse = build_parser().parse_args
    got = _config(parse(["train", "--config", str(flat)]))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "deprecated" in lines[0] and "mesh -> [parallel] mesh" in lines[0], lines
    assert got == _config(parse(["train", "--config", str(sections)]))
    assert got.model.name == "gpt2-tiny" and got.parallel.mesh == "fsdp=8" and got.checkpoint.save_every == 7
    with pytest.warns(DeprecationWarning, match="parallel.mesh"):
        assert TrainConfig(model="gpt2-tiny", mesh="fsdp=8") == with_overrides(
            TrainConfig(), {"model.name": "gpt2-tiny", "parallel.mesh": "fsdp=8"}
        )
    # A run directory written by 0.1 holds the flat names: the same run, no conflict.
    old = {**{k: v for k, v in got.to_dict().items() if k not in ("model", "parallel", "checkpoint", "logging")},
           "model": "gpt2-tiny", "mesh": "data=8", "dtype": "float32", "dropout": 0.0, "remat": "full",
           "init_from": None, "rules": "auto", "min_shard_bytes": 1 << 20, "microbatches": None,
           "pipeline_repeats": 1, "save_every": 7, "keep": 3, "log_every": 10, "eval_every": 100}  # fmt: skip
    assert config_conflicts(old, got.to_dict()) == []
    assert config_conflicts({**old, "dropout": 0.1}, got.to_dict()) == [
        "model.dropout: run directory has 0.1, this command has 0.0"
    ]


def test_a_config_written_before_newer_fields_is_the_same_run():
    """``tests/data/config_a887e9d.json`` is the config.json that nnxscale wrote at a887e9d
    (2026-11-23, before the package redesign, --document-mask, --skip-bad-rows and
    --text-field) for ``train --model gpt2-tiny --mesh data=8 --batch-size 16 --seq-len 32
    --steps 6 --save-every 3 --log-every 1 --eval-every 0 --warmup-steps 2 --min-lr-ratio 1.0``.
    The same command today is the same run: the fields it lacks have their defaults there,
    which is what that version did. (Refused as a different run before this was fixed; the
    run directory itself resumed and continued with the losses of an uninterrupted run.)"""
    from nnxscale.cli.commands import _config, build_parser
    from nnxscale.training.config import config_conflicts

    saved = json.loads((Path(__file__).parent / "data" / "config_a887e9d.json").read_text())["train"]
    argv = ["train", "--model", "gpt2-tiny", "--mesh", "data=8", "--batch-size", "16", "--seq-len", "32", "--steps", "10",
            "--save-every", "5", "--log-every", "1", "--eval-every", "0", "--warmup-steps", "2", "--min-lr-ratio", "1.0"]  # fmt: skip
    now = _config(build_parser().parse_args(argv)).to_dict()
    now["optim"]["decay_steps"] = saved["optim"]["decay_steps"]  # the trainer keeps the first command's schedule
    assert config_conflicts(saved, now) == []
    now["data"]["document_mask"] = True  # a field the old run did not have, set otherwise: a different run
    assert config_conflicts(saved, now) == ["data.document_mask: run directory has False, this command has True"]


def test_config_file_with_an_unknown_field(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text("stepz = 3\n")
    code, _, err = run_main(capsys, ["train", "--config", str(config), "--run-dir", str(tmp_path / "r")])
    assert_one_error_line(code, err, "stepz")
    assert not (tmp_path / "r").exists()


def test_user_errors_are_one_line_but_a_bug_keeps_its_traceback(monkeypatch, capsys):
    import nnxscale
    from nnxscale.cli import commands as cli

    for name in ("MeshError", "LayoutError", "RulesError", "ConfigError", "ModelError", "DataError", "CheckpointError"):
        assert issubclass(getattr(nnxscale, name), nnxscale.NnxscaleError), name

    def bug(args):
        raise KeyError("an internal bug")

    monkeypatch.setattr(cli, "_plan", bug)
    with pytest.raises(KeyError, match="an internal bug"):  # not turned into "nnxscale: error: ..."
        main(["plan"])
    assert "nnxscale: error" not in capsys.readouterr().err


def test_remat_takes_a_policy_and_a_bare_flag_means_full():
    from nnxscale.cli.commands import build_parser
    from nnxscale.training.config import ModelSettings

    parse = build_parser().parse_args
    assert getattr(parse(train_args("r", "d", "--remat")), "model.remat") == "full"
    assert getattr(parse(train_args("r", "d", "--remat", "dots")), "model.remat") == "dots"
    assert getattr(parse(train_args("r", "d", "--remat", "dots-except-mlp-in")), "model.remat") == "dots-except-mlp-in"
    assert getattr(parse(train_args("r", "d", "--remat", "--seed", "3")), "model.remat") == "full"  # a bare flag before another
    assert getattr(parse(train_args("r", "d")), "model.remat") is None  # the config's own (none) unless given
    assert ModelSettings(remat=True).remat == "full" and ModelSettings(remat=False).remat == "none"
    with pytest.raises(SystemExit):
        parse(train_args("r", "d", "--remat", "some"))


def test_the_command_line_reads_its_arguments_before_jax_starts():
    # --cpu-devices must reach XLA before jax is imported: building the parser must not import it
    code = "import sys; from nnxscale.cli import commands as cli; cli.build_parser(); assert 'jax' not in sys.modules, 'jax imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_cpu_devices_that_come_too_late_are_said_to(capsys):
    """Called from Python with jax already running on 8 devices, --cpu-devices 4 cannot
    apply: one line says so; asking for the count jax has says nothing."""
    plan = ["plan", "--model", "gpt2-tiny", "--compile", "never"]
    code, _, err = run_main(capsys, [*plan, "--cpu-devices", "4"])
    assert code == 0 and "nnxscale: note: --cpu-devices 4 has no effect here: jax is already running in this " \
        "process with 8 CPU devices" in err, err  # fmt: skip
    code, _, err = run_main(capsys, [*plan, "--cpu-devices", "8"])
    assert code == 0 and "no effect" not in err, err


def test_train_plan_and_init_take_the_same_settings_with_the_same_defaults(tmp_path):
    """One source of truth: the flags come from the config dataclasses, so the same flags
    give the same run in `train`, `plan` and `init` (and no flags, the quick start's)."""
    from nnxscale.cli.commands import INIT_SETTINGS, PLAN_SETTINGS, _config, build_parser
    from nnxscale.training.config import TrainConfig, fields_of, flag

    parse = build_parser().parse_args
    run = ["--run-dir", str(tmp_path / "r")]
    assert _config(parse(["train"])) == _config(parse(["plan"])) == TrainConfig()
    assert _config(parse(["init", *run])) == _config(parse(["train", *run]))
    given = ["--model", "gpt2-tiny", "--mesh", "fsdp=8", "--rules", "fsdp", "--min-shard-bytes", "0"]
    assert _config(parse(["plan", *given])) == _config(parse(["train", *given]))
    assert _config(parse(["init", *given, *run])) == _config(parse(["train", *given, *run]))
    settings = fields_of()
    for command, paths in (("plan", PLAN_SETTINGS), ("init", INIT_SETTINGS), ("train", settings)):
        parser = build_parser()._subparsers._group_actions[0].choices[command]
        flags = {a.dest: a for a in parser._actions}
        for path in paths:
            negated = [f"--no-{flag(path)[2:]}"] if settings[path].type in (bool, "bool") else []  # --no-document-mask
            assert flags[path].option_strings == [flag(path), *negated], (command, path)
            assert settings[path].metadata["help"] in flags[path].help
