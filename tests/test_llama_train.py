"""Llama through the same trainer, CLI and planner as GPT-2: the same losses on every mesh,
resume on another mesh, a seed checkpoint from `init`, fine-tuning a Hugging Face Llama
directory on text through its own tokenizer, sampling words, and a compiled plan."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_testing import greedy_by_hand
from test_cli import run_main
from test_train import assert_params_equal, capture_first_state, captured_values, flat, quiet_train, tiny_cfg
from tokenizers import Tokenizer

import nnxscale
from nnxscale.checkpoint.checkpointer import checkpoint_dir
from nnxscale.training.rundir import read_metrics
from nnxscale.models import llama

STEPS = 4


def llama_cfg(run_dir, data, **overrides):
    return tiny_cfg(run_dir, data, **{"model": "llama-tiny", "steps": STEPS, **overrides})


@pytest.fixture(scope="module")
def llama_ref(tmp_path_factory, text_data):
    """llama-tiny on data=8, uninterrupted, every step logged."""
    run_dir = tmp_path_factory.mktemp("llama") / "run"
    result = quiet_train(llama_cfg(run_dir, text_data))
    assert result.final_step == STEPS
    records = read_metrics(run_dir)
    assert len({r["loss"] for r in records}) == STEPS  # it learns: every step differs
    return run_dir, records


def assert_same_run(got, want, what):
    assert [r["step"] for r in got] == [r["step"] for r in want], what
    for a, b in zip(got, want):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5, err_msg=f"{what} step {a['step']}")
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-4, err_msg=f"{what} step {a['step']}")


# 16 query heads on 8 K/V heads: model=4 splits both; fsdp splits the matrices' embed rows.
# (One K/V head per device, model=8: test_llama's logits and shard shapes on every mesh.)
@pytest.mark.parametrize("mesh", ["fsdp=8", pytest.param("data=2,model=4", marks=pytest.mark.extended)])
def test_llama_logs_the_same_losses_on_every_mesh(tmp_path, text_data, llama_ref, mesh):
    _, want = llama_ref
    quiet_train(llama_cfg(tmp_path / "run", text_data, mesh=mesh))
    assert_same_run(read_metrics(tmp_path / "run"), want, mesh)


@pytest.mark.extended  # the suite's: test_train's resume on another mesh (gpt2), test_llama's tensor-parallel step
def test_llama_resumes_on_another_mesh(tmp_path, text_data, llama_ref):
    _, want = llama_ref
    run_dir = tmp_path / "run"
    quiet_train(llama_cfg(run_dir, text_data, steps=3))  # past the 2 warmup steps: the same schedule
    assert sorted(p.name for p in checkpoint_dir(run_dir).iterdir()) == ["3"]
    result = quiet_train(llama_cfg(run_dir, text_data, mesh="data=2,model=4"))
    assert result.start_step == 3 and result.final_step == STEPS
    assert_same_run(read_metrics(run_dir), want, "resumed on data=2,model=4")


@pytest.mark.extended  # the suite's: test_train's seed checkpoint (gpt2), the Hugging Face Llama run's sample below
def test_llama_seed_checkpoint_from_init_and_sample(tmp_path, text_data, llama_ref, capsys):
    """`nnxscale init --model llama-tiny` writes the parameters a fresh run starts from;
    `sample` continues a prompt from a Llama run."""
    run_dir, want = llama_ref
    code, out, err = run_main(capsys, ["init", "--model", "llama-tiny", "--mesh", "fsdp=8", "--run-dir", str(tmp_path / "seed")])
    assert code == 0 and "llama-tiny" in out, err
    quiet_train(llama_cfg(tmp_path / "run", text_data, steps=1, init_from=str(tmp_path / "seed")))
    assert read_metrics(tmp_path / "run")[0]["loss"] == want[0]["loss"]  # seed 0 both times

    code, out, err = run_main(capsys, ["sample", "--run-dir", str(run_dir), "--prompt", "def ",
                                       "--max-new-tokens", "8", "--temperature", "0"])  # fmt: skip
    assert code == 0, err
    model = nnxscale.load_model(run_dir, warn=lambda line: None)
    ids = list(b"def ") + greedy_by_hand(model, list(b"def "), 8, window=16)
    assert out == bytes(ids).decode("utf-8", errors="replace") + "\n"


def test_fine_tune_a_hugging_face_llama_directory_on_text(tmp_path, text_data, bpe_tokenizer, monkeypatch, capsys):
    """``--model DIR``: a Llama directory written in Hugging Face's layout (sharded
    safetensors with an index, as published Llamas are) with its tokenizer.json gives the
    architecture (from config.json, no preset needed), the first step's weights (in this
    run's layout) and the tokenizer; the run resumes, samples words, and exports back to a
    directory that loads to the same logits."""
    config = llama.preset("llama-tiny", vocab_size=512, tie_word_embeddings=False)  # the tokenizer's vocabulary
    hf = tmp_path / "Llama-tiny-bpe"
    source = llama.Llama(config, rngs=nnx.Rngs(7))
    llama.save_pretrained(source, hf, max_shard_bytes=200_000)
    assert (hf / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bpe_tokenizer.with_name(name), hf / name)

    # From the command line: train (its first step starts from the directory's weights, laid
    # out on this run's mesh), resume, sample words.
    run_dir = tmp_path / "run"
    seen = capture_first_state(monkeypatch)
    args = ["train", "--model", str(hf), "--mesh", "data=2,model=4", "--data", str(text_data), "--run-dir", str(run_dir),
            "--batch-size", "16", "--seq-len", "32", "--log-every", "1", "--steps", "3", "--save-every", "0", "--eval-every", "0"]  # fmt: skip
    code, out, err = run_main(capsys, args)
    assert code == 0, err
    monkeypatch.undo()
    start = {k: np.asarray(v) for k, v in flat(nnx.to_pure_dict(nnx.state(source))).items()}
    assert_params_equal(captured_values(seen), start)
    assert flat(seen["params"])["['layers']['mlp']['gate_proj']['kernel']"].shard_shape == (2, 128, 96)  # 384 / 4
    assert (run_dir / "tokenizer.json").read_bytes() == bpe_tokenizer.read_bytes()
    code, out, err = run_main(capsys, [*args[:-6], "--steps", "4", "--save-every", "0", "--eval-every", "0"])
    assert code == 0 and f"resumed {run_dir} from step 3" in out, err
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]

    # Export the fine-tuned model: Hugging Face's layout again, the run's logits.
    tok = Tokenizer.from_file(str(bpe_tokenizer))
    model = nnxscale.load_model(run_dir)
    llama.save_pretrained(model, tmp_path / "out")
    back = llama.from_pretrained(tmp_path / "out")
    inputs = jnp.asarray(tok.encode("def parse(self, args):").ids)[None]
    np.testing.assert_array_equal(np.asarray(back(inputs)), np.asarray(model(inputs)))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"
    moved = {k: np.asarray(v) for k, v in flat(nnx.to_pure_dict(nnx.state(back))).items()}
    assert moved.keys() == start.keys() and any(not np.array_equal(moved[k], start[k]) for k in moved)  # it trained

    # Sampling decodes with the run's tokenizer, also once the directory is gone.
    shutil.rmtree(hf)
    prompt = "def parse"
    got = nnxscale.sample(run_dir, prompt, max_new_tokens=6, temperature=0)
    assert got == prompt + tok.decode(greedy_by_hand(model, tok.encode(prompt).ids, 6, config.max_position_embeddings))


def test_llama_plan_compiles_the_step_and_its_layout_matches_the_run(text_data):
    cfg = tiny_cfg("unused", text_data, model="llama-tiny", mesh="data=2,model=4")
    plan = nnxscale.plan(cfg, compile="always")
    assert plan.num_params == llama.preset("llama-tiny").num_params()
    s = nnxscale.setup(cfg)
    want = sum(int(np.prod(nnxscale.shard_shape(a.shape, a.sharding.spec, s.mesh))) * a.dtype.itemsize
               for a in jax.tree.leaves(s.abstract["params"]))  # fmt: skip
    assert plan.param_bytes == want and plan.peak_bytes > want
    assert any("fitted to gpt2's step" in note for note in plan.notes)



def test_model_names_a_directory_that_is_not_a_hugging_face_model(tmp_path, text_data, capsys):
    from test_cli import assert_one_error_line

    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "config.json").write_text("{}")  # no safetensors beside it
    weights = str(tmp_path / "weights")
    for name, words in ((weights, (f"--model {weights} holds config.json but no weights", "train needs them", "--init-from")),
                        ("models/Llama-3.2-1B", ("--model models/Llama-3.2-1B: not a Hugging Face model directory", "not a preset"))):
        code, _, err = run_main(capsys, ["train", "--model", name, "--data", str(text_data), "--run-dir", str(tmp_path / "run")])
        assert_one_error_line(code, err, *words)
        assert not (tmp_path / "run").exists()
