"""GPT-2 against Hugging Face's own implementation.

tests/data/hf_gpt2 holds a random ``GPT2LMHeadModel`` written by transformers' own
``save_pretrained`` (its ``config.json``, ``model.safetensors`` with ``transformer.``-prefixed
names and the head tied to the token embedding), a batch of tokens and transformers' float32
logits for them in eval mode (tools/make_gpt2_fixture.py, run by hand in a separate
environment with torch). nnxscale loads that directory the way ``--model DIR`` does, and
must give the same logits on one device and on a mesh, and write the same tensors back.
"""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import nnxscale
from model_testing import jit_logits, params_by_path, rules_for, sharded_logits
from nnxscale.models import gpt2, is_pretrained_dir, pretrained_family

HF_FIXTURE = Path(__file__).parent / "data" / "hf_gpt2"
MODEL_DIR = HF_FIXTURE / "model"


@pytest.fixture(scope="module")
def fixture():
    return np.load(HF_FIXTURE / "tokens.npy"), np.load(HF_FIXTURE / "hf_logits.npy")


def load(mesh=None):
    """The public path: the family from config.json's model_type, as ``--model DIR`` finds it."""
    assert is_pretrained_dir(MODEL_DIR)
    family = pretrained_family(MODEL_DIR)
    assert family.name == "gpt2"
    rules = None if mesh is None else rules_for(mesh)
    model = family.from_pretrained(MODEL_DIR, mesh=mesh, rules=rules)
    assert model.config == family.pretrained_config(MODEL_DIR)
    return family, model


@pytest.mark.parametrize("spec", [None, "data=2,model=4", "fsdp=8"])
def test_logits_match_a_checkpoint_written_by_hugging_face(spec, fixture):
    tokens, want = fixture
    assert tokens.shape == (2, 16) and want.shape == (2, 16, 96) and want.dtype == np.float32
    assert np.abs(want).max() > 0.1  # logits of a random model, not zeros
    if spec is None:
        _, model = load()
        got = jit_logits(model, tokens)
    else:
        mesh = nnxscale.make_mesh(spec)
        _, model = load(mesh)
        layouts = [v.sharding for v in jax.tree.leaves(nnx.state(model, nnx.Param))]
        assert any(not s.is_fully_replicated for s in layouts), f"nothing sharded on {spec}"
        got = sharded_logits(model, mesh, np.repeat(tokens, 4, axis=0))[::4]  # 8 rows: a batch fsdp=8 splits
    c = model.config
    assert (c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head) == (96, 64, 32, 2, 4)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_written_back_in_hugging_face_layout_tensor_for_tensor(tmp_path):
    family, model = load()
    family.save_pretrained(model, tmp_path / "out")
    theirs = load_file(MODEL_DIR / "model.safetensors")
    ours = load_file(tmp_path / "out" / "model.safetensors")
    # transformers' GPT2LMHeadModel writes its base model's names prefixed with "transformer.";
    # nnxscale writes them unprefixed, as the published gpt2 checkpoints are (both load).
    theirs = {k.removeprefix("transformer."): v for k, v in theirs.items()}
    assert theirs.keys() == ours.keys()
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype, name
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    # and what it wrote loads back to the same model
    again = gpt2.from_pretrained(tmp_path / "out")
    assert again.config == model.config
    want = params_by_path(model)
    for k, v in params_by_path(again).items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
