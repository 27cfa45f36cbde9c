"""Your own module from Python: the example of docs/own-model.md, run as the page shows it.

The code is the page's block itself (the first python block under "Train your own model
from Python"), so the two cannot drift apart: it trains, samples, and resumes (run in this
process, which has the 8 devices it asks for); its classes are checked for the layout the
rules give and the decay mask.
"""

import os
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P
from test_cli import assert_one_error_line, run_main

import nnxscale
from nnxscale.training.step import ENV_STEP_XLA_OPTIONS

DOC = Path(__file__).resolve().parent.parent / "docs" / "own-model.md"
HEADING = "# Train your own model from Python"


def doc_example() -> str:
    text = DOC.read_text()
    start = text.index("```python\n", text.index(HEADING)) + len("```python\n")
    return text[start : text.index("```\n", start)]


def run_example(code: str, cwd: Path, monkeypatch, capsys) -> str:
    """Run the page's code here, in ``cwd``, and return what it printed. This process has its
    8 devices already, so the page's first line (8 CPU devices, set before jax starts) finds
    them; what it sets in the environment is put back afterwards."""
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.chdir(cwd)
        m.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
        for name in [k for k in os.environ if k.startswith("NNXSCALE_") and k != ENV_STEP_XLA_OPTIONS]:
            m.delenv(name)  # as a user runs it; the suite's step options (tests/conftest.py) stay
        exec(compile(code, str(DOC), "exec"), {"__name__": "__main__"})
    return capsys.readouterr().out


@pytest.mark.many_steps
def test_the_doc_example_trains_samples_and_resumes(tmp_path, capsys, monkeypatch):
    code = doc_example()
    printed = run_example(code, tmp_path, monkeypatch, capsys)
    out = printed.splitlines()
    assert out[0].startswith("weight decay 0.1 on 9 of 22 parameter arrays"), out
    assert out[1].startswith("step 40: loss "), out
    assert out[2] == ("TransformerLM has no KV cache (init_cache and hidden_states(..., cache=)): every new token "
                      "recomputes the whole sequence"), out  # fmt: skip
    # The rest is the sample: the prompt and up to 40 new bytes of whatever the corpus (this
    # Python's own library) taught it, newlines included.
    sample = printed.split("\n", 3)[3].removesuffix("\n")
    assert sample.startswith("def ") and len(sample) <= 4 + 40, out
    run_dir = tmp_path / "runs" / "my-lm"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["20", "40"]
    losses = [r["loss"] for r in nnxscale.read_metrics(run_dir)]
    assert losses[-1] < losses[0] - 1.0  # it learns
    # The command line cannot rebuild a module of your own: it says how to sample it.
    exit_code, _, err = run_main(capsys, ["sample", "--run-dir", str(run_dir)])
    assert_one_error_line(exit_code, err, "a module of your own", "model=factory")

    more = code.replace("steps=40,", "steps=50,")
    assert more != code
    out = run_example(more, tmp_path, monkeypatch, capsys)
    assert f"resumed {Path('runs/my-lm')} from step 40 on mesh data=2,model=4" in out
    assert "step 50: loss " in out
    assert [r["step"] for r in nnxscale.read_metrics(run_dir)][-1] == 50


def test_the_doc_example_is_laid_out_by_its_rules(tmp_path, monkeypatch):
    code = doc_example()
    definitions = code[: code.index("result = nnxscale.train(")].replace('os.environ["XLA_FLAGS"]', "_unused")
    scope: dict = {}
    exec(compile(definitions, str(DOC), "exec"), scope)
    monkeypatch.chdir(tmp_path)
    s = nnxscale.setup(scope["cfg"], model=scope["my_lm"])
    specs = {jax.tree_util.keystr(p): sh.spec for p, sh in jax.tree_util.tree_flatten_with_path(s.param_shardings)[0]}
    assert specs["['blocks']['mha']['query']['kernel']"] == P(None, None, "model", None)  # (layers, C, heads, head_dim)
    assert specs["['blocks']['mha']['out']['kernel']"] == P(None, "model", None, None)
    assert specs["['blocks']['linear1']['kernel']"] == P(None, None, "model")  # hidden: the rules' own name
    assert specs["['blocks']['linear2']['kernel']"] == P(None, "model", None)
    assert specs["['token_emb']['embedding']"] == P("model", None)
    assert specs["['blocks']['layer_norm1']['scale']"] == P(None, None)
    decays = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(s.decay_mask)[0]}
    assert sorted(k for k, v in decays.items() if v) == [
        "['blocks']['linear1']['kernel']", "['blocks']['linear2']['kernel']", "['blocks']['mha']['key']['kernel']",
        "['blocks']['mha']['out']['kernel']", "['blocks']['mha']['query']['kernel']",
        "['blocks']['mha']['value']['kernel']", "['head']['kernel']", "['pos_emb']['embedding']",
        "['token_emb']['embedding']",
    ]  # fmt: skip
    assert s.vocab_size() == 256 and s.flops_per_token() == 6 * s.num_params
