"""The models' own chat templates, Qwen3's and Gemma 3's, through nnxscale's chat SFT
(only the assistant's turns trained) and ``sample --chat``'s prompt.

The templates in ``tests/data/chat`` are verbatim copies (their SHA-256 is pinned below):

- ``qwen3.jinja``: Qwen3's ``chat_template`` (Qwen/Qwen3-8B's tokenizer_config.json: ``<think>``
  handling, ``enable_thinking``, tool calls, ``messages[::-1]``, ``namespace``), from
  huggingface/trl ``trl/chat_templates/qwen3.jinja`` at f2cd57710ae345ea6428ae95363267fcf38a3dc8
  (file last changed in f44cf20bd8c9e43954c7e2f72b01e8070fbc38d1; TRL compares it for equality
  with the tokenizers' template to pick its training variant, so it must be the exact text).
- ``gemma3.jinja``: Gemma 3's (google/gemma-3-*-it tokenizer_config.json: ``bos_token``, the
  system message folded into the first user turn, ``raise_exception`` on role alternation),
  from huggingface/trl ``trl/chat_templates/gemma3.jinja`` at the same commit (last changed in
  909d0c16bba33cac5bccdb2e7d587bae07321ef7); identical to the JSON-escaped copy of gemma-3's
  tokenizer_config.json in ShishirPatil/gorilla
  ``berkeley-function-call-leaderboard/bfcl/model_handler/local_inference/gemma.py`` at
  72055c51cf809ba0ee04b4332a3515d7ec8549a5.

The expected renderings below were checked once by hand against transformers 5.25.0
(``transformers.utils.chat_template_utils.render_jinja_template``, what ``apply_chat_template``
calls); transformers is not a test dependency: :func:`render_like_transformers` redoes its
environment with plain Jinja2 for the comparisons over more conversations.
"""

import hashlib
import json
from pathlib import Path

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

import nnxscale
from nnxscale.data import chat
from nnxscale.training import sampling
from test_chat import CONVERSATION, TEMPLATES

QWEN3_SHA256 = "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"
GEMMA3_SHA256 = "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4"
# The tokenizers' own special and added tokens (Qwen3: <think> and </think> are added tokens, not special).
SPECIAL = {"qwen3": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
           "gemma3": ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"]}  # fmt: skip
ADDED = {"qwen3": ["<think>", "</think>", "<tool_call>", "</tool_call>"], "gemma3": []}
# tokenizer_config.json: Qwen/Qwen3-8B's and google/gemma-3-4b-it's end-of-text (and Gemma's bos) tokens.
CONFIG = {"qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
          "gemma3": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}}  # fmt: skip

# transformers 5.25.0's apply_chat_template(CONVERSATION, tokenize=False), and the prompts
# apply_chat_template(CONVERSATION[:2] / [:4], add_generation_prompt=True).
QWEN3_FULL = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
              "<|im_start|>user\nHi there <|im_end|>\n"
              "<|im_start|>assistant\nHello!<|im_end|>\n"  # before the last user message: no <think> block
              "<|im_start|>user\nBye<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n\n</think>\n\nBye.<|im_end|>\n")  # after it: an empty <think> block  # fmt: skip
GEMMA3_FULL = ("<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"  # system folded in; content | trim
               "<start_of_turn>model\nHello!<end_of_turn>\n"
               "<start_of_turn>user\nBye<end_of_turn>\n"
               "<start_of_turn>model\nBye.<end_of_turn>\n")  # fmt: skip
WANT = {
    "qwen3": {
        "full": QWEN3_FULL,
        "prompt2": QWEN3_FULL[: QWEN3_FULL.index("Hello!")],
        "prompt4": QWEN3_FULL[: QWEN3_FULL.index("<think>")],
        # the first turn alone: the answer after the last user message gets the empty <think> block
        "turn3": QWEN3_FULL[: QWEN3_FULL.index("Hello!")] + "<think>\n\n</think>\n\nHello!<|im_end|>\n",
    },
    "gemma3": {
        "full": GEMMA3_FULL,
        "prompt2": GEMMA3_FULL[: GEMMA3_FULL.index("Hello!")],
        "prompt4": GEMMA3_FULL[: GEMMA3_FULL.index("Bye.")],
        "turn3": GEMMA3_FULL[: GEMMA3_FULL.index("<start_of_turn>user\nBye")],
    },
}
END = {"qwen3": "<|im_end|>\n", "gemma3": "<end_of_turn>\n"}


def render_like_transformers(source: str, messages, add_generation_prompt=False, **kwargs) -> str:
    """The template rendered as transformers' ``render_jinja_template`` renders it."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(messages=messages, tools=None, documents=None,
                                          add_generation_prompt=add_generation_prompt, **kwargs)  # fmt: skip


def make_dir(directory: Path, name: str, as_file: bool) -> Path:
    """A byte-level tokenizer.json with the model's special tokens, its tokenizer_config.json,
    and its chat template: in ``chat_template.jinja`` (``as_file``) or the config's field."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL[name])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED[name]])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {k: v for k, v in CONFIG[name].items() if v is not None}
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    if as_file:
        (directory / chat.TEMPLATE_FILE).write_text(source, encoding="utf-8")
    else:
        config["chat_template"] = source
    (directory / chat.TOKENIZER_CONFIG).write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def model_dir(request, tmp_path_factory):
    """Qwen3 with its template in tokenizer_config.json; Gemma 3 with chat_template.jinja beside it."""
    name = request.param
    return name, make_dir(tmp_path_factory.mktemp(name), name, as_file=(name == "gemma3"))


def decoded(tok, ex):
    """The text of the trained tokens, and of the others."""
    ids = ex.tokens.tolist()
    pick = lambda flag: tok._tokenizer.decode([i for i, t in zip(ids, ex.trained) if t == flag],  # noqa: E731
                                              skip_special_tokens=False)  # fmt: skip
    return pick(True), pick(False)


# ---------------------------------------------------------------------------------------
# the templates


def test_templates_are_the_models_own():
    """Verbatim copies (pinned), using what nnxscale's environment must provide."""
    qwen, gemma = ((TEMPLATES / n).read_text(encoding="utf-8") for n in ("qwen3.jinja", "gemma3.jinja"))
    assert hashlib.sha256(qwen.encode()).hexdigest() == QWEN3_SHA256
    assert hashlib.sha256(gemma.encode()).hexdigest() == GEMMA3_SHA256
    for needle in ("namespace(", "messages[::-1]", "enable_thinking", "reasoning_content", "tool_calls", "| tojson"):
        assert needle in qwen
    for needle in ("bos_token", "first_user_prefix", "raise_exception(", "<start_of_turn>", "<end_of_turn>"):
        assert needle in gemma


def test_renders_as_transformers_does(model_dir):
    name, directory = model_dir
    template = chat.ChatTemplate.find(directory)
    assert template.special == {k: v for k, v in CONFIG[name].items() if v is not None}
    assert not template.generation_blocks
    want = WANT[name]
    assert template.render(CONVERSATION) == want["full"]
    assert template.render(CONVERSATION[:2], add_generation_prompt=True) == want["prompt2"]
    assert template.render(CONVERSATION[:4], add_generation_prompt=True) == want["prompt4"]
    assert template.render(CONVERSATION[:3]) == want["turn3"]
    # ... and as plain Jinja2 in transformers' environment renders it, over more conversations
    reasoning = [*CONVERSATION[:4], {"role": "assistant", "content": "<think>\nShort.\n</think>\n\nBye."}]
    listed = [{"role": "user", "content": [{"type": "text", "text": " Look "}]}, {"role": "assistant", "content": "Ok"}]
    no_system = CONVERSATION[1:]
    conversations = [CONVERSATION, CONVERSATION[:3], reasoning, listed, no_system]
    if name == "qwen3":  # tool calls (tojson of the arguments), a tool turn, reasoning_content
        call = {"function": {"name": "add", "arguments": {"a": 1, "b": "é"}}}
        conversations += [
            [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": "2"}, {"role": "assistant", "content": "2."}],
            [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"},
             {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"}],
        ]  # fmt: skip
    for messages in conversations:
        for prompt in (False, True):
            ours = template.render(messages, add_generation_prompt=prompt)
            assert ours == render_like_transformers(template.text, messages, prompt, **template.special)


def test_qwen3_think_blocks():
    """The empty <think></think> block as the template writes it: on the answer after the last
    user message only; a reasoning answer's thinking kept there and dropped from earlier answers;
    the generation prompt opens the turn without one (enable_thinking is not given)."""
    template = chat.ChatTemplate((TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8"), "qwen3")
    text = template.render(CONVERSATION)
    assert text.count("<think>\n\n</think>\n\n") == 1 and text.endswith("<think>\n\n</think>\n\nBye.<|im_end|>\n")
    thought = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nwhy\n</think>\n\nA"},
               {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "<think>\nhow\n</think>\n\nA2"}]  # fmt: skip
    assert template.render(thought) == ("<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
                                        "<|im_start|>user\nQ2<|im_end|>\n"
                                        "<|im_start|>assistant\n<think>\nhow\n</think>\n\nA2<|im_end|>\n")  # fmt: skip
    assert template.render(thought[:3], add_generation_prompt=True).endswith("<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n")
    # transformers' enable_thinking=False would append the empty block to the prompt; nnxscale passes no enable_thinking
    assert render_like_transformers(template.text, thought[:1], True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert template.render(thought[:1], add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_gemma3_refuses_what_its_template_refuses(tmp_path):
    template = chat.ChatTemplate.find(make_dir(tmp_path, "gemma3", as_file=True))
    with pytest.raises(chat.RowError, match="the chat template refuses it: Conversation roles must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    tok = nnxscale.load_tokenizer(tmp_path)
    with pytest.raises(chat.RowError, match="Conversation roles must alternate"):
        chat.Renderer(tok, template).messages([{"role": "assistant", "content": "first"}])


# ---------------------------------------------------------------------------------------
# what is trained


def check_trained(name, directory, messages, want_spans):
    tok = nnxscale.load_tokenizer(directory)
    template = chat.ChatTemplate.find(directory)
    text, spans = template.assistant_spans(messages)
    assert text == template.render(messages)
    assert [text[a:b] for a, b in spans] == want_spans
    renderer = chat.Renderer(tok, template)
    ex = renderer.messages(messages)
    trained, context = decoded(tok, ex)
    assert trained == "".join(want_spans)
    assert ex.tokens.tolist() == tok.encode_plain([text])[0]  # the same tokens as the whole text encoded
    # each answer's prompt is exactly what `sample --chat` feeds the model, untrained; its first answer token trained
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            prompt = tok.encode_plain([template.render(messages[:i], add_generation_prompt=True)])[0]
            assert ex.tokens[: len(prompt)].tolist() == prompt and ex.trained[len(prompt)]
    i = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    first = tok.encode_plain([template.render(messages[:i], add_generation_prompt=True)])[0]
    assert not ex.trained[: len(first)].any()  # the system and first user turns: context only
    return ex, context


def test_gemma3_trains_the_model_turns_only(tmp_path):
    directory = make_dir(tmp_path, "gemma3", as_file=True)
    ex, context = check_trained("gemma3", directory, CONVERSATION, ["Hello!<end_of_turn>\n", "Bye.<end_of_turn>\n"])
    assert context.startswith("<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n<start_of_turn>model\n")
    tok = nnxscale.load_tokenizer(directory)
    assert chat.packing_separator(tok, chat.ChatTemplate.find(directory)) == tok.token_id("<eos>")  # not written by the template


def test_qwen3_trains_the_assistant_turns_only(tmp_path):
    directory = make_dir(tmp_path, "qwen3", as_file=False)
    # the earlier answer as the whole conversation renders it (no <think> block), the last with its empty block
    check_trained("qwen3", directory, CONVERSATION, ["Hello!<|im_end|>\n", "<think>\n\n</think>\n\nBye.<|im_end|>\n"])


def test_qwen3_single_turn_trains_its_think_block(tmp_path):
    """One answer: the empty block the template writes (or the thinking given) is the model's to write, trained."""
    directory = make_dir(tmp_path, "qwen3", as_file=False)
    ex, context = check_trained("qwen3", directory, CONVERSATION[:3], ["<think>\n\n</think>\n\nHello!<|im_end|>\n"])
    assert context == "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there <|im_end|>\n<|im_start|>assistant\n"
    thought = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nwhy\n</think>\n\nA"}]
    check_trained("qwen3", directory, thought, ["<think>\nwhy\n</think>\n\nA<|im_end|>\n"])
    tok = nnxscale.load_tokenizer(directory)
    # eos <|im_end|> ends every turn: the packing separator is <|endoftext|>
    assert chat.packing_separator(tok, chat.ChatTemplate.find(directory)) == tok.token_id("<|endoftext|>")


# ---------------------------------------------------------------------------------------
# sample --chat


def test_chat_prompt_opens_the_assistant_turn(model_dir):
    name, directory = model_dir
    tok = nnxscale.load_tokenizer(directory)
    encoded, turn_end = sampling._chat_prompts(directory, directory, tok, ["What is 3 + 3?", "Hi"])
    # the reply stops at the token that ends an assistant's turn in the template, too
    assert turn_end == tok.token_id({"qwen3": "<|im_end|>", "gemma3": "<end_of_turn>"}[name]) is not None
    opened = {"qwen3": "<|im_start|>user\nWhat is 3 + 3?<|im_end|>\n<|im_start|>assistant\n",
              "gemma3": "<bos><start_of_turn>user\nWhat is 3 + 3?<end_of_turn>\n<start_of_turn>model\n"}[name]  # fmt: skip
    assert encoded[0] == tok.encode_plain([opened])[0]
    assert tok._tokenizer.decode(encoded[0], skip_special_tokens=False) == opened
    if name == "gemma3":
        assert encoded[0][0] == tok.token_id("<bos>") and encoded[0].count(tok.token_id("<bos>")) == 1


def test_a_reply_ends_at_the_templates_end_of_turn():
    """Gemma ends an answer with <end_of_turn>, not its eos_token: sample --chat stops there too."""
    for name, end in (("gemma3", "<end_of_turn>"), ("qwen3", "<|im_end|>")):
        template = chat.ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"), name)
        assert template.turn_end() == end, name
