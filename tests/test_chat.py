"""Instruction, chat and preference data: chat templates rendered as transformers renders
them, only the assistant's tokens trained, bad rows named or counted, ``sample --chat``, and
DPO against a by-hand computation on one device and on ``fsdp=2,model=4``.

The expected renderings below are written by hand from the templates in ``tests/data/chat``
and Jinja2's semantics (``trim_blocks``, ``lstrip_blocks``, ``-`` whitespace control), not
copied from nnxscale's output.
"""

import dataclasses
import datetime
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_testing import greedy_by_hand, jit_logits
from test_cli import assert_one_error_line, run_main
from test_train import quiet_train, tiny_cfg

import nnxscale
from nnxscale.data import chat
from nnxscale.data import tokens as datalib
from nnxscale.layers import lora as lora_layers
from nnxscale.errors import DataError
from nnxscale.models import chunked_next_token_loss, gpt2, llama
from nnxscale.models.common.documents import IGNORED
from nnxscale.planning.layout import layout_figures
from nnxscale.training.rundir import read_metrics

TEMPLATES = Path(__file__).parent / "data" / "chat"
SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>",
           "<|im_start|>", "<|im_end|>", "<|endoftext|>"]  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Bye."},
]


def byte_tokenizer(directory: Path, eos: str, bos=None, template_field=None, template_file=None) -> Path:
    """A byte-level tokenizer.json (256 byte tokens, no merges, the special tokens above) and
    a tokenizer_config.json naming ``eos``/``bos``, with a chat template in it or beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": eos, **({"bos_token": bos} if bos else {})}
    if template_field:
        config["chat_template"] = (TEMPLATES / template_field).read_text()
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file:
        shutil.copy(TEMPLATES / template_file, directory / chat.TEMPLATE_FILE)
    return directory


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    """Llama 3 Instruct's layout: the template in tokenizer_config.json, eos_token <|eot_id|>."""
    return byte_tokenizer(tmp_path_factory.mktemp("llama3"), "<|eot_id|>", "<|begin_of_text|>", template_field="llama3.jinja")


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    """ChatML as current transformers save it: chat_template.jinja, with {% generation %} blocks."""
    return byte_tokenizer(tmp_path_factory.mktemp("chatml"), "<|im_end|>", template_file="chatml.jinja")


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory, llama3_dir):
    """A small Llama in a Hugging Face directory with the Llama-3-style tokenizer and template."""
    config = llama.preset("llama-tiny", vocab_size=272, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    hf = tmp_path_factory.mktemp("hf") / "Llama-chat"
    llama.save_pretrained(llama.Llama(config, rngs=nnx.Rngs(3)), hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama3_dir / name, hf / name)
    return hf


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------
# rendering


def test_llama3_template_renders_as_written_by_hand(llama3_dir):
    template = chat.ChatTemplate.find(llama3_dir)
    assert template.special == {"eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"}
    want = ("<|begin_of_text|>"
            "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"  # content | trim
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nBye.<|eot_id|>")  # fmt: skip
    assert template.render(CONVERSATION) == want
    prompt = template.render(CONVERSATION[:2], add_generation_prompt=True)
    assert prompt == want[: want.index("Hello!")]
    text, spans = template.assistant_spans(CONVERSATION)  # by prefix renders: no {% generation %}
    assert not template.generation_blocks and text == want
    assert [text[a:b] for a, b in spans] == ["Hello!<|eot_id|>", "Bye.<|eot_id|>"]


def test_chatml_template_with_generation_blocks(chatml_dir):
    template = chat.ChatTemplate.find(chatml_dir)  # chat_template.jinja
    want = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nHi there <|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\nBye.<|im_end|>\n")  # fmt: skip
    text, spans = template.assistant_spans(CONVERSATION)
    assert template.generation_blocks and text == want
    assert [text[a:b] for a, b in spans] == ["Hello!<|im_end|>", "Bye.<|im_end|>"]  # the blocks, not the "\n"
    assert template.render(CONVERSATION[:4], add_generation_prompt=True) == want[: want.rindex("Bye.")]
    with pytest.raises(chat.RowError, match="the chat template refuses it: Conversation roles must be .* not tool"):
        template.render([{"role": "tool", "content": "42"}])


def test_environment_is_transformers_one():
    """trim_blocks, lstrip_blocks, loopcontrols, a tojson that keeps non-ASCII and HTML
    characters, strftime_now: each changes this rendering if missing."""
    source = ("{% for m in messages %}\n  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
              "[{{ m.content | tojson }}]\n{% endfor %}\n{{ strftime_now('%d %b %Y') }}")  # fmt: skip
    template = chat.ChatTemplate(source, "test", now=datetime.datetime(2024, 7, 26))
    messages = [{"role": "user", "content": 'é "q"'}, {"role": "skip", "content": "x"}, {"role": "user", "content": "<b>"}]
    assert template.render(messages) == '["é \\"q\\""]\n["<b>"]\n26 Jul 2024'


# ---------------------------------------------------------------------------------------
# examples: what is trained


def decoded_targets(tok, ex):
    """The text of the trained tokens, and of the others."""
    ids = ex.tokens.tolist()
    return (tok._tokenizer.decode([i for i, t in zip(ids, ex.trained) if t], skip_special_tokens=False),
            tok._tokenizer.decode([i for i, t in zip(ids, ex.trained) if not t], skip_special_tokens=False))  # fmt: skip


def test_only_assistant_tokens_are_trained(llama3_dir, chatml_dir):
    for directory, end in ((llama3_dir, "<|eot_id|>"), (chatml_dir, "<|im_end|>")):
        tok = nnxscale.load_tokenizer(directory)
        renderer = chat.Renderer(tok, chat.ChatTemplate.find(directory))
        ex = renderer.messages(CONVERSATION)
        trained, context = decoded_targets(tok, ex)
        assert trained == f"Hello!{end}Bye.{end}"
        assert "You are terse." in context and "Hi there" in context and "Hello" not in context
        # the prompt's tokens are those `sample --chat` feeds the model
        prompt = renderer.template.render(CONVERSATION[:2], add_generation_prompt=True)
        n = len(tok.encode_plain([prompt])[0])
        assert ex.tokens[:n].tolist() == tok.encode_plain([prompt])[0] and ex.trained[n] and not ex.trained[:n].any()
        assert chat.Renderer(tok, renderer.template, "all").messages(CONVERSATION).trained.all()
    # prompt and completion as text: the prompt with the tokenizer's special tokens, then the completion and eos
    tok = nnxscale.load_tokenizer(llama3_dir)
    ex = chat.Renderer(tok, None).completion("2+2=", " 4")
    assert decoded_targets(tok, ex) == (" 4<|eot_id|>", "2+2=")
    # ... or as messages: only the completion's assistant message is trained
    ex = chat.Renderer(tok, chat.ChatTemplate.find(llama3_dir)).completion(CONVERSATION[:3], CONVERSATION[3:])
    assert decoded_targets(tok, ex)[0] == "Bye.<|eot_id|>"


def test_packing_keeps_examples_whole_and_masks_the_rest(llama3_dir):
    tok = nnxscale.load_tokenizer(llama3_dir)
    template = chat.ChatTemplate.find(llama3_dir)
    sep = chat.packing_separator(tok, template)
    # eos <|eot_id|> ends every turn, so not it: the first known end-of-text token the tokenizer has
    assert sep == tok.token_id("<|endoftext|>") and sep != tok.separator
    examples = [chat.Example(np.arange(1, n + 1, dtype=np.int32), np.arange(n) >= 2) for n in (5, 4, 6)]
    tokens, trained = chat.pack(examples, 12, sep)
    rows, marks = tokens.reshape(-1, 12), trained.reshape(-1, 12)
    assert rows[0].tolist() == [1, 2, 3, 4, 5, sep, 1, 2, 3, 4, sep, sep]  # the third does not fit: a new row
    assert rows[1].tolist() == [1, 2, 3, 4, 5, 6, sep] + [sep] * 5
    assert marks[0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0]
    # the batches: IGNORED targets exactly where the rows are not trained
    it = datalib.train_batches(tokens, seq_len=11, global_batch_size=2, seed=0, process_index=0, process_count=1,
                               trained=trained)  # fmt: skip
    batch = next(it)
    it.close()
    for x, y in zip(batch["inputs"], batch["targets"]):
        i = next(r for r in range(2) if rows[r][:-1].tolist() == x.tolist())
        assert y.tolist() == np.where(marks[i][1:], rows[i][1:], IGNORED).tolist()


# ---------------------------------------------------------------------------------------
# the loss


def test_prompt_targets_change_neither_loss_nor_gradient(llama3_dir):
    """The loss and its gradient, with the targets the data pipeline gives (IGNORED where
    the rendering says "context"): a prompt token's target does not matter, a completion's does."""
    tok = nnxscale.load_tokenizer(llama3_dir)
    ex = chat.Renderer(tok, chat.ChatTemplate.find(llama3_dir)).messages(CONVERSATION)
    T = len(ex) - 1
    model = gpt2.GPT2(gpt2.preset("gpt2-tiny", vocab_size=272, n_positions=128), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    inputs = jnp.asarray(ex.tokens[None, :-1])
    trained = ex.trained[None, 1:]

    @jax.jit
    def loss_and_grad(params, targets):
        masked = jnp.where(trained, targets, IGNORED)  # what the pipeline hands the step
        f = lambda p: chunked_next_token_loss(nnx.merge(graphdef, p), inputs, masked, ignored_targets=True)  # noqa: E731
        return jax.value_and_grad(f)(params)

    value_and_grad = lambda targets: loss_and_grad(params, targets)  # noqa: E731
    targets = np.asarray(ex.tokens[None, 1:])
    loss, grads = value_and_grad(targets)
    # by hand: the mean cross-entropy over the trained positions only
    logp = jax.nn.log_softmax(jit_logits(model, inputs).astype(np.float32))[0]
    picked = np.asarray(logp)[np.arange(T), targets[0]]
    np.testing.assert_allclose(float(loss), -picked[trained[0]].mean(), rtol=1e-6)

    prompt, completion = np.flatnonzero(~trained[0]), np.flatnonzero(trained[0])
    assert len(prompt) > 20 and len(completion) > 5
    for position in (prompt[0], prompt[len(prompt) // 2], prompt[-1]):
        other = targets.copy()
        other[0, position] = (other[0, position] + 7) % 256
        loss2, grads2 = value_and_grad(other)
        assert float(loss2) == float(loss)
        jax.tree.map(np.testing.assert_array_equal, grads2, grads)
    other = targets.copy()
    other[0, completion[1]] = (other[0, completion[1]] + 7) % 256
    loss3, grads3 = value_and_grad(other)
    assert float(loss3) != float(loss)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(grads3), jax.tree.leaves(grads)))


# ---------------------------------------------------------------------------------------
# the command line: training on chats, bad rows, sampling with --chat


def chat_rows(n: int):
    return [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                          {"role": "assistant", "content": f"{i} + {i} is {2 * i}."}]} for i in range(n)]  # fmt: skip


def chat_args(hf, data, run_dir, *extra):
    return ["train", "--model", str(hf), "--mesh", "data=2,model=4", "--data", str(data), "--run-dir", str(run_dir),
            "--batch-size", "8", "--seq-len", "64", "--steps", "2", "--log-every", "1", "--save-every", "0",
            "--eval-every", "0", "--no-progress", *extra]  # fmt: skip


def test_train_on_chats_then_sample_with_the_template(tmp_path, hf_llama, capsys):
    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(40))
    run_dir = tmp_path / "run"
    code, out, err = run_main(capsys, chat_args(hf_llama, data, run_dir, "--document-mask"))
    assert code == 0, err
    assert "data: " in out and "40 conversations" in out and "--loss-on completion" in out
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert (run_dir / "tokenizer_config.json").is_file()  # the template goes with the run
    code, out, err = run_main(capsys, ["sample", "--run-dir", str(run_dir), "--chat", "--prompt", "What is 3 + 3?",
                                       "--max-new-tokens", "4", "--temperature", "0"])  # fmt: skip
    assert code == 0, err
    # the reply alone, greedy, after the rendered prompt
    tok = nnxscale.load_tokenizer(run_dir)
    template = chat.ChatTemplate.find(run_dir)
    prompt = tok.encode_plain([template.render([{"role": "user", "content": "What is 3 + 3?"}], add_generation_prompt=True)])[0]
    model = nnxscale.load_model(run_dir, warn=lambda line: None)
    reply = greedy_by_hand(model, prompt, 4, window=128)
    stop = tok.separator
    reply = reply[: reply.index(stop)] if stop in reply else reply
    assert out == tok.decode(reply) + "\n"


BAD_ROWS = [
    ({"text": "no messages here"}, ["row 2", "no 'messages'", "--skip-bad-rows"]),
    ({"messages": [{"role": "tool", "content": "42"}]}, ["row 2", "the chat template refuses it", "Unknown role: tool"]),
    ({"messages": [{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "y"}]},
     ["row 2", "longer than a sequence (--seq-len 64)"]),
    ("{not json", ["row 2", "not JSON"]),
    ({"messages": [{"role": "user", "content": "only a question"}]}, ["row 2", "nothing to train"]),
]  # fmt: skip


@pytest.mark.parametrize("bad,words", BAD_ROWS, ids=["no-messages", "role", "too-long", "not-json", "no-assistant"])
def test_bad_rows_are_named_or_skipped_and_counted(tmp_path, hf_llama, capsys, bad, words):
    rows = chat_rows(20)
    data = write_jsonl(tmp_path / "chats.jsonl", [rows[0], bad, *rows[1:]])
    code, _, err = run_main(capsys, chat_args(hf_llama, data, tmp_path / "run"))
    assert_one_error_line(code, err, str(data), *words)
    assert not (tmp_path / "run").exists()
    # the same data through the library, skipping: counted
    tok = nnxscale.load_tokenizer(hf_llama)
    renderer = chat.Renderer(tok, chat.ChatTemplate.find(hf_llama))
    packed = chat.load_examples([data], renderer, kind=chat.MESSAGES, seq_len=64, separator=None, skip_bad_rows=True)
    assert (packed.examples, packed.bad_rows) == (20, 1)
    with pytest.raises(DataError, match="row 2"):
        chat.load_examples([data], renderer, kind=chat.MESSAGES, seq_len=64, separator=None)


# ---------------------------------------------------------------------------------------
# DPO


PAIRS = [("Q: 2+2? A:", " 4", " 5"), ("Q: sky? A:", " blue", " green"), ("Q: 3*3? A:", " 9", " 6"),
         ("Q: cat? A:", " meow", " woof")]  # fmt: skip


def dpo_by_hand(model, reference, beta: float):
    """The DPO loss, reward margin and accuracy over PAIRS, from each model's full logits."""

    def log_prob(m, prompt: str, answer: str) -> float:
        ids = list(prompt.encode()) + list(answer.encode()) + [0]  # bytes, the answer, then end-of-text (byte 0)
        padded = np.zeros((1, 24), np.int32)  # one shape, one compiled forward; causal: the padding after does not matter
        padded[0, : len(ids)] = ids
        logp = np.asarray(jax.nn.log_softmax(jit_logits(m, jnp.asarray(padded)).astype(jnp.float32)))[0]
        return float(sum(logp[i - 1, ids[i]] for i in range(len(prompt.encode()), len(ids))))

    margins = []
    for prompt, chosen, rejected in PAIRS:
        c = log_prob(model, prompt, chosen) - log_prob(reference, prompt, chosen)
        r = log_prob(model, prompt, rejected) - log_prob(reference, prompt, rejected)
        margins.append(beta * (c - r))
    margins = np.asarray(margins)
    return float(np.mean(np.log1p(np.exp(-margins)))), float(margins.mean()), float(np.mean(margins > 0))


@pytest.mark.parametrize("mesh, lora", [
    ("data=1", True), ("fsdp=2,model=4", False),
    pytest.param("data=1", False, marks=pytest.mark.extended), pytest.param("fsdp=2,model=4", True, marks=pytest.mark.extended),
], ids=["data=1-lora", "fsdp=2,model=4-full", "data=1-full", "fsdp=2,model=4-lora"])  # fmt: skip
def test_dpo_loss_matches_a_computation_by_hand(tmp_path, mesh, lora):
    """Under LoRA the reference is the base with the adapters off: the state holds no copy
    of the weights, and the by-hand reference is the base model alone (no adapters)."""
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    # every step sees every pair (a batch of all 8 rows), so step 2's loss is over PAIRS
    devices = nnxscale.make_mesh(mesh, devices=jax.devices()[:1]) if mesh == "data=1" else None
    settings = {"data.batch_size": 8, "data.seq_len": 24, "data.val_fraction": 0.0, "optim.lr": 1e-2}
    if lora:  # a large step: the adapters must move the policy away from its reference
        settings |= {"lora.rank": 4, "optim.lr": 5e-2}
    for steps in (1, 2):  # the second run resumes: the reference comes back from the checkpoint (LoRA: with the base)
        cfg = tiny_cfg(tmp_path / "run", data, mesh=mesh, steps=steps, objective="dpo", dpo_beta=0.5, **settings)
        nnxscale.train(cfg, mesh=devices, progress=False, log=lambda _: None)
        if steps == 1:
            after_one = nnxscale.load_model(cfg.run_dir, warn=lambda line: None)
    first, second = read_metrics(cfg.run_dir)
    reference = gpt2.GPT2(gpt2.preset("gpt2-tiny"), rngs=nnx.Rngs(0))  # seed 0: the run's starting point (LoRA: its base)
    if lora:  # no second copy of the weights, and the planner counts none: the same as a LoRA run of the lm objective
        dpo, lm = (layout_figures(dataclasses.replace(cfg, objective=o), {"fsdp": 2, "model": 4}) for o in ("dpo", "lm"))
        assert "reference" not in dpo["setup"].abstract and "base" in dpo["setup"].abstract
        assert dpo["param_bytes"] == lm["param_bytes"] and dpo["optimizer_bytes"] == lm["optimizer_bytes"]
        assert len(lora_layers.adapted(after_one)) > 0
    assert first["loss"] == pytest.approx(np.log(2), rel=1e-6) and first["reward_margin"] == 0  # the model is its reference
    loss, margin, accuracy = dpo_by_hand(after_one, reference, 0.5)
    assert second["loss"] == pytest.approx(loss, rel=1e-5)
    assert second["reward_margin"] == pytest.approx(margin, rel=1e-4, abs=1e-6)
    assert second["reward_accuracy"] == accuracy
    assert second["loss"] < first["loss"]  # it learns to prefer the chosen answers


def test_dpo_needs_pairs_and_pairs_need_dpo(tmp_path, capsys, text_data):
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    from test_cli import train_args

    code, _, err = run_main(capsys, train_args(tmp_path / "a", pairs))
    assert_one_error_line(code, err, "preference pairs", "--objective dpo")
    code, _, err = run_main(capsys, train_args(tmp_path / "b", text_data, "--objective", "dpo"))
    assert_one_error_line(code, err, "--objective dpo", "prompt, chosen and rejected")
    code, _, err = run_main(capsys, train_args(tmp_path / "c", text_data, "--loss-on", "completion"))
    assert_one_error_line(code, err, "--loss-on completion", "is text")
    code, _, err = run_main(capsys, train_args(tmp_path / "d", pairs, "--objective", "dpo", "--grad-accum", "2"))
    assert_one_error_line(code, err, "--objective dpo with --grad-accum 2", "not implemented")
    for flags in (["--loss-on", "completion"], ["--objective", "dpo"]):  # a missing file is missing, not "text"
        code, _, err = run_main(capsys, train_args(tmp_path / "e", tmp_path / "missing.jsonl", *flags))
        assert_one_error_line(code, err, "missing.jsonl", "does not exist")
