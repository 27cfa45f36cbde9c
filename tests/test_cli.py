"""The command line on bad input: one clear line on stderr, a non-zero exit, no traceback,
and nothing already saved in the run directory lost. Plus ``plan`` and ``train --help``."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from nnxscale.checkpoint import Checkpointer, checkpoint_dir
from nnxscale.cli import main
from nnxscale.config import TrainConfig
from nnxscale.train import setup


def train_args(run_dir, data, *extra) -> list[str]:
    """A small valid ``train`` command; flags in ``extra`` override (argparse: last wins)."""
    return [
        "train", "--model", "gpt2-tiny", "--mesh", "data=8", "--batch-size", "16", "--seq-len", "32",
        "--steps", "4", "--save-every", "2", "--eval-every", "0", "--data", str(data),
        "--run-dir", str(run_dir), "--no-progress", *extra,
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
    code = main(argv)
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


def test_damaged_newest_checkpoint(saved_run, text_data, tmp_path):
    """Through a real process: the error names the checkpoint, no traceback, nothing deleted."""
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    newest = checkpoint_dir(run_dir) / "4"
    data_files = [p for p in newest.rglob("*") if p.is_file() and p.parent.name == "d" and "ocdbt" in str(p)]
    assert data_files
    for p in data_files:  # cut every array chunk of step 4 in half
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    before = snapshot(run_dir)

    env = {k: v for k, v in os.environ.items() if k != "NNXSCALE_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "nnxscale", *train_args(run_dir, text_data, "--steps", "6")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert_one_error_line(proc.returncode, proc.stderr, "checkpoint step 4", str(newest))
    assert snapshot(run_dir) == before  # both checkpoints, metrics and config untouched

    # The older checkpoint is still whole: a run can be restored from it.
    cfg = TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text())["train"])
    s = setup(cfg)
    with Checkpointer(checkpoint_dir(run_dir), async_save=False) as ckpt:
        state, extras = ckpt.restore(s.abstract, step=2)
    assert int(state["step"]) == 2
    assert extras["data"]["grain"]["next_index"] == 2


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
        'model = "gpt2-tiny"\nmesh = "fsdp=8"\nsteps = 3\n'
        "[optim]\nlr = 0.002\nwarmup_steps = 1\n"
        "[data]\nseq_len = 32\nbatch_size = 16\n"
    )
    run_dir = tmp_path / "run"
    argv = ["train", "--config", str(config), "--steps", "2", "--data", str(text_data),
            "--run-dir", str(run_dir), "--eval-every", "0", "--no-progress"]  # fmt: skip
    code, out, err = run_main(capsys, argv)
    assert code == 0, err
    saved = json.loads((run_dir / "config.json").read_text())["train"]
    assert saved["mesh"] == "fsdp=8" and saved["optim"]["lr"] == 0.002 and saved["data"]["seq_len"] == 32
    assert saved["steps"] == 2  # the flag wins over the file
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [2]


def test_config_file_with_an_unknown_field(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text("stepz = 3\n")
    code, _, err = run_main(capsys, ["train", "--config", str(config), "--run-dir", str(tmp_path / "r")])
    assert_one_error_line(code, err, "stepz")
    assert not (tmp_path / "r").exists()


def test_user_errors_are_one_line_but_a_bug_keeps_its_traceback(monkeypatch, capsys):
    import nnxscale
    from nnxscale import cli

    for name in ("MeshError", "LayoutError", "RulesError", "ConfigError", "ModelError", "DataError", "CheckpointError"):
        assert issubclass(getattr(nnxscale, name), nnxscale.NnxscaleError), name

    def bug(args):
        raise KeyError("an internal bug")

    monkeypatch.setattr(cli, "_plan", bug)
    with pytest.raises(KeyError, match="an internal bug"):  # not turned into "nnxscale: error: ..."
        main(["plan"])
    assert "nnxscale: error" not in capsys.readouterr().err


def test_remat_takes_a_policy_and_a_bare_flag_means_full():
    from nnxscale.cli import build_parser

    parse = build_parser().parse_args
    assert parse(train_args("r", "d", "--remat")).remat == "full"
    assert parse(train_args("r", "d", "--remat", "dots")).remat == "dots"
    assert parse(train_args("r", "d", "--remat", "--seed", "3")).remat == "full"  # a bare flag before another
    assert parse(train_args("r", "d")).remat is None  # the config's own (none) unless given
    assert TrainConfig(remat=True).remat == "full" and TrainConfig(remat=False).remat == "none"
    with pytest.raises(SystemExit):
        parse(train_args("r", "d", "--remat", "some"))


def test_the_command_line_reads_its_arguments_before_jax_starts():
    # --cpu-devices must reach XLA before jax is imported: building the parser must not import it
    code = "import sys; from nnxscale import cli; cli.build_parser(); assert 'jax' not in sys.modules, 'jax imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
