"""Instruction, chat and preference data: rows rendered by the model's chat template, the
prompt masked out of the loss, examples packed whole into rows.

Row formats of a JSON Lines (``.jsonl``, ``.jsonl.gz``, ``.json``) or Parquet file, found
from its first row (:func:`record_format`):

- ``messages``: a conversation, a list of ``{"role", "content"}``, rendered by the model's
  own chat template (:class:`ChatTemplate`).
- ``prompt`` and ``completion``: text (the prompt encoded with the tokenizer's special
  tokens, the completion after it without, then the end-of-text token), or lists of
  messages (rendered by the template as one conversation, prompt first).
- ``prompt``, ``chosen`` and ``rejected`` (``--objective dpo``): two examples, the prompt
  with each answer, as ``prompt``/``completion`` makes them.
- anything else is text (``--text-field``), read by :mod:`nnxscale.data.text`.

**What is trained** (``--loss-on completion``, the default for these formats): the tokens
of the assistant's messages, their end-of-turn token included, and of a completion; the
system and user turns and the prompt are context only: their targets are
:data:`IGNORED`, which the loss skips. Assistant turns are found by rendering the
conversation's prefixes: the text the template adds for message ``i`` is
``render(messages[:i + 1])`` minus ``render(messages[:i], add_generation_prompt=True)``,
which is exactly what a model sampled with that prompt writes. A template that writes an
earlier answer differently once a user message follows it (Qwen3 drops its ``<think>``
block) trains that answer as the whole conversation writes it. A template with
``{% generation %}`` blocks (Hugging Face's marker for ``return_assistant_tokens_mask``)
says it itself, and those blocks are used instead. Each span is encoded on its own (no
special tokens added), so the prompt's tokens are those ``sample --chat`` feeds the model.
``--loss-on all`` trains every token.

**Packing**: each example is kept whole. Examples are placed in file order into rows of
``seq_len + 1`` tokens (the inputs are a row's first ``seq_len``, the targets its last),
each followed by the packing separator (:func:`packing_separator`); a row that cannot take
the next example is filled with the separator, untrained. ``--document-mask`` keeps the
examples of a row apart (attention, positions). Preference pairs take a row each, the
chosen one then the rejected one (a group of 2 rows, never split).

**Bad rows**: no ``messages`` (or ``prompt``/``completion``...), a message the template
refuses (``raise_exception``), nothing to train, or an example longer than ``seq_len``
tokens: an error naming the file and row, or with ``--skip-bad-rows`` skipped and counted.

Templates are rendered with Jinja2 as Hugging Face ``transformers`` renders them (its
``apply_chat_template``): a sandboxed environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII
text, ``raise_exception`` and ``strftime_now``, and the tokenizer's special tokens
(``bos_token``, ``eos_token``...) as variables. ``strftime_now`` (Llama 3.1's
"Today Date") gives, in training, the data file's modification time, so a resumed run
renders the same tokens; ``sample --chat`` gives the current time.
"""

from __future__ import annotations

import dataclasses
import datetime
import gzip
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import jinja2
import numpy as np
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nnxscale.data.text import SEPARATOR, open_parquet
from nnxscale.errors import DataError, storage_error

#: The target of a token the loss does not train (a prompt token's): Hugging Face's ``-100``.
IGNORED = -100

#: Row formats (:func:`record_format`).
TEXT, MESSAGES, COMPLETION, PREFERENCE = "text", "messages", "completion", "preference"

#: Where a Hugging Face directory keeps its chat template: a file (current transformers) or a field.
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"

#: Tokens that end a document in well-known tokenizers: packing separators the templates do not write.
_END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")

#: A neutral conversation rendered to see which tokens a template writes.
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
          {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye"}]  # fmt: skip


class RowError(ValueError):
    """A row that cannot become an example; its message says why (the caller adds file and row)."""


# ---------------------------------------------------------------------------------------
# the chat template


class ChatTemplate:
    """A Hugging Face chat template, compiled as ``transformers`` compiles it.

    Attributes:
      source: where it was read (a file, or ``tokenizer_config.json``'s field).
      text: the Jinja source.
      special: the special tokens the template sees as variables (``bos_token``...).
      generation_blocks: whether it marks assistant text with ``{% generation %}``.
    """

    def __init__(self, text: str, source: str, special: Optional[dict] = None, now: Optional[datetime.datetime] = None):
        self.source, self.text, self.special = source, text, dict(special or {})
        self._now = now
        pieces: list = []  # the current render's text so far, as generated
        spans: list = []  # the current render's generation blocks, (start, end) in characters
        self._pieces, self._spans = pieces, spans

        class _Generation(Extension):
            """``{% generation %}...{% endgeneration %}``: record where the block's text lands."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

            def _block(self, caller):
                # The block's text is the next piece generated (transformers' AssistantTracker
                # assumes the same: a block inside a macro or a captured {% set %} is not seen).
                text = caller()
                start = sum(map(len, pieces))
                spans.append((start, start + len(text)))
                return text

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            return (self._now or datetime.datetime.now()).strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, jinja2.ext.loopcontrols])  # fmt: skip
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(text)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise DataError(f"chat template {source}: not a Jinja2 template (line {e.lineno}: {e.message})") from None
        self._error = jinja2.exceptions.TemplateError
        self.generation_blocks = "generation" in text and _has_generation_tag(env, text)

    @classmethod
    def find(cls, directory, *, now: Optional[datetime.datetime] = None) -> Optional["ChatTemplate"]:
        """The template of a Hugging Face (or run) directory: ``chat_template.jinja``, else
        ``tokenizer_config.json``'s ``chat_template`` (its ``default`` when it holds several
        named ones); ``None`` when it has neither."""
        directory = Path(directory)
        config = _read_json(directory / TOKENIZER_CONFIG)
        special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in config.items()
                   if k.endswith("_token") and isinstance(v, (str, dict))}  # fmt: skip
        special = {k: v for k, v in special.items() if isinstance(v, str)}
        file = directory / TEMPLATE_FILE
        if file.is_file():
            try:
                return cls(file.read_text(encoding="utf-8"), str(file), special, now)
            except (OSError, UnicodeDecodeError) as e:
                raise DataError(f"cannot read the chat template {file} ({e})") from None
        text = config.get("chat_template")
        if isinstance(text, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
            text = named.get("default")
        if isinstance(text, str) and text.strip():
            return cls(text, f"{directory / TOKENIZER_CONFIG} (chat_template)", special, now)
        return None

    def turn_end(self) -> Optional[str]:
        """The text the template writes right after an assistant's answer, up to whitespace
        (``<end_of_turn>`` for Gemma, ``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3):
        where a reply ends, whatever the tokenizer's end-of-text token is; None when the
        template writes nothing there."""
        try:
            text = self.render(_PROBE[:2])
        except RowError:
            return None
        at = text.rfind("Hello")
        tail = text[at + len("Hello") :].strip().split()
        return tail[0] if at >= 0 and tail else None

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text, as ``apply_chat_template(messages, tokenize=False)``.

        Raises RowError with the template's own message when it refuses the conversation.
        """
        return self._render(messages, add_generation_prompt)[0]

    def _render(self, messages, add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        """``(text, generation blocks' spans)``: the blocks are found in the generated stream."""
        self._pieces.clear()
        self._spans.clear()
        variables = {**self.special, "messages": list(messages), "tools": None, "documents": None,
                     "add_generation_prompt": add_generation_prompt}  # fmt: skip
        try:
            for piece in self._template.generate(**variables):
                self._pieces.append(piece)
        except self._error as e:
            raise RowError(f"the chat template refuses it: {e}") from None
        except (TypeError, AttributeError, KeyError) as e:  # e.g. content that is not text
            raise RowError(f"the chat template cannot render it ({type(e).__name__}: {e})") from None
        return "".join(self._pieces), list(self._spans)

    def assistant_spans(self, messages: Sequence[dict], first: int = 0) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the rendered conversation and the ``(start, end)`` characters of
        its assistant messages from message ``first`` on (see the module docstring)."""
        if self.generation_blocks:
            text, spans = self._render(messages, False)
            if first:  # the blocks of the first messages are the prompt's
                before = len(self._render(messages[:first], True)[1])
                spans = spans[before:]
            return text, spans
        text = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if i < first or message.get("role") != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            turn = self.render(messages[: i + 1])
            if turn.startswith(prompt) and text.startswith(turn):
                spans.append((len(prompt), len(turn)))
                continue
            end = _rewritten_answer_end(prompt, turn, text)
            if end is None:
                raise RowError(
                    f"the chat template renders message {i + 1}'s conversation so far differently from the whole "
                    "(a template that rewrites earlier turns), so its assistant turns cannot be found by prefix: "
                    "give the template {% generation %} blocks, or use --loss-on all"
                )
            spans.append((len(prompt), end))
        return text, spans


def _has_generation_tag(env, text: str) -> bool:
    """Whether the template's source uses the ``generation`` tag (not just the word)."""
    try:
        return any(t[1] == "name" and t[2] == "generation" for t in env.lex(text))
    except Exception:  # lexing a template that compiled does not fail; be safe
        return False


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path} as JSON ({e})") from None
    return value if isinstance(value, dict) else {}


def template_directory(tokenizer) -> Optional[Path]:
    """The directory whose chat template goes with ``tokenizer`` (a ``TextTokenizer``): its own."""
    return None if tokenizer is None or not hasattr(tokenizer, "path") else Path(tokenizer.path).parent


# ---------------------------------------------------------------------------------------
# examples


@dataclasses.dataclass(frozen=True)
class Example:
    """One trained sequence: ``tokens`` int ``(n,)`` and ``trained`` bool ``(n,)``: token ``i``
    is a target of the loss (predicted from the tokens before it)."""

    tokens: np.ndarray
    trained: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


class Renderer:
    """Rows -> :class:`Example` s, with a tokenizer and (for messages) a chat template.

    ``loss_on``: ``"completion"`` (assistant and completion tokens only) or ``"all"``.
    """

    def __init__(self, tokenizer, template: Optional[ChatTemplate], loss_on: str = "completion"):
        self.tokenizer, self.template, self.loss_on = tokenizer, template, loss_on

    def _encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids, no special tokens added (a chat template writes its own)."""
        encode = getattr(self.tokenizer, "encode_plain", None)
        return encode(list(texts)) if encode is not None else [self.tokenizer.encode(t) for t in texts]

    def _example(self, pieces: Sequence[list[int]], trained: Sequence[bool]) -> Example:
        tokens = np.asarray([t for p in pieces for t in p], np.int32)
        mask = np.concatenate([np.full(len(p), bool(flag)) for p, flag in zip(pieces, trained)] or [np.zeros(0, bool)])
        if self.loss_on == "all":
            mask = np.ones(len(tokens), bool)
        if len(tokens) < 2 or not mask[1:].any():
            raise RowError("nothing to train: no assistant message or completion with any token")
        return Example(tokens, mask)

    def messages(self, messages, first: int = 0) -> Example:
        """A conversation through the chat template; assistant messages from ``first`` on are trained."""
        if self.template is None:
            raise DataError(
                "chat data (messages) needs the model's chat template: a chat_template.jinja or a tokenizer_config.json "
                "with chat_template beside the tokenizer (--tokenizer DIR, or the Hugging Face directory of --model)"
            )
        check_messages(messages)
        text, spans = self.template.assistant_spans(messages, first)
        edges = sorted({0, len(text), *(e for span in spans for e in span)})
        cuts = list(zip(edges[:-1], edges[1:]))
        inside = [any(a <= start and end <= b for a, b in spans) for start, end in cuts]
        return self._example(self._encode([text[a:b] for a, b in cuts]), inside)

    def completion(self, prompt, completion) -> Example:
        """A prompt and its completion: text (prompt with the tokenizer's special tokens, the
        completion, the end-of-text token) or lists of messages (one conversation)."""
        if isinstance(prompt, list) and isinstance(completion, list):
            return self.messages(prompt + completion, first=len(prompt))
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise RowError(f"prompt and completion must both be text or both lists of messages, got "
                           f"{type(prompt).__name__} and {type(completion).__name__}")  # fmt: skip
        end = self.tokenizer.separator
        if end is None:
            raise DataError(f"{self.tokenizer.description}: no end-of-text token to end a completion with")
        head = self.tokenizer.encode(prompt)  # with the tokenizer's own special tokens (Llama 3's <|begin_of_text|>)
        return self._example([head, self._encode([completion])[0] + [end]], [False, True])


def check_messages(messages) -> None:
    """Raise RowError unless ``messages`` is a non-empty list of ``{"role": str, "content": ...}``."""
    if not isinstance(messages, list) or not messages:
        raise RowError(f"'messages' must be a non-empty list of {{role, content}}, got {_short(messages)}")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise RowError(f"message {i} is not {{\"role\": ..., \"content\": ...}}: {_short(m)}")


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------
# rows of a file


def iter_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """``(row number, value)`` of every non-empty row of a JSON Lines or Parquet file, from 1;
    a line that is not JSON gives a :class:`RowError` as its value."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        table = open_parquet(path)
        row = 0
        for batch in table.iter_batches(batch_size=1024):
            for value in batch.to_pylist():
                row += 1
                yield row, value
        return
    try:
        with open(path, "rb") as raw:
            binary = gzip.GzipFile(fileobj=raw) if name.endswith(".gz") else raw
            with io.TextIOWrapper(binary, encoding="utf-8") as f:
                for row, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        yield row, json.loads(line)
                    except ValueError as e:
                        yield row, RowError(f"not JSON ({e})")
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: cannot be read as UTF-8 JSON Lines ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise storage_error("reading", path, e) from None


def format_of(row) -> str:
    """The format of one row (see the module docstring)."""
    if not isinstance(row, dict):
        return TEXT
    if "messages" in row:
        return MESSAGES
    if "prompt" in row and "chosen" in row and "rejected" in row:
        return PREFERENCE
    if "prompt" in row and "completion" in row:
        return COMPLETION
    return TEXT


def record_format(source, record_files: Callable[[Any], Sequence[Path]]) -> str:
    """The format of a data source: its first record file's first JSON row's; ``text`` for
    anything else. ``record_files(source)``: the JSON Lines and Parquet files of a source."""
    for path in record_files(source):
        for _, value in iter_rows(path):
            if not isinstance(value, RowError):
                return format_of(value)
        return TEXT
    return TEXT


# ---------------------------------------------------------------------------------------
# packing


def packing_separator(tokenizer, template: Optional[ChatTemplate]) -> Optional[int]:
    """The token placed after each example: the tokenizer's end-of-text token, unless the
    chat template writes it inside conversations (Llama 3 Instruct's ``eos_token`` is
    ``<|eot_id|>``, which ends every turn), then the first of ``<|endoftext|>``,
    ``<|end_of_text|>``, ``</s>``, ``<eos>`` the tokenizer has and the template does not
    write. ``None`` when none fits. Byte-level text: byte 0."""
    if tokenizer is None or not hasattr(tokenizer, "token_id"):
        return SEPARATOR
    written: set[int] = set()
    if template is not None:
        try:
            written = set(Renderer(tokenizer, template)._encode([template.render(_PROBE)])[0])
        except RowError:
            written = set()
    candidates = [tokenizer.separator] + [tokenizer.token_id(t) for t in _END_TOKENS]
    return next((c for c in candidates if c is not None and c not in written), None)


@dataclasses.dataclass
class Packed:
    """Examples packed into rows: ``tokens`` and ``trained`` ``(rows * row_tokens,)``."""

    tokens: np.ndarray
    trained: np.ndarray
    row_tokens: int
    examples: int
    bad_rows: int
    group: int  # rows that belong together (2: a preference pair)


def pack(examples: Sequence[Example], row_tokens: int, separator: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
    """Examples in order into rows of ``row_tokens``, each followed by ``separator`` (when
    there is one and room for it); the rest of a row is ``separator`` (or 0), untrained."""
    pad = 0 if separator is None else separator
    rows_t, rows_m = [], []
    row_t: list[np.ndarray] = []
    used = 0

    def close():
        nonlocal used
        if not row_t:
            return
        fill = row_tokens - used
        rows_t.append(np.concatenate(row_t + [np.full(fill, pad, np.int32)]))
        rows_m.append(np.concatenate(row_m + [np.zeros(fill, bool)]))
        row_t.clear()
        row_m.clear()
        used = 0

    row_m: list[np.ndarray] = []
    for ex in examples:
        n = len(ex) + (separator is not None)
        if used + n > row_tokens:
            close()
        tokens, mask = ex.tokens, ex.trained
        if separator is not None and len(ex) < row_tokens:
            tokens = np.append(tokens, np.int32(separator))
            mask = np.append(mask, False)
        row_t.append(tokens.astype(np.int32))
        row_m.append(mask)
        used += len(tokens)
        if used >= row_tokens:
            close()
    close()
    if not rows_t:
        return np.zeros(0, np.int32), np.zeros(0, bool)
    return np.concatenate(rows_t), np.concatenate(rows_m)


def load_examples(
    files: Sequence[Path],
    renderer: Renderer,
    *,
    kind: str,
    seq_len: int,
    separator: Optional[int],
    skip_bad_rows: bool = False,
) -> Packed:
    """Every row of ``files`` as examples of format ``kind``, packed into rows of ``seq_len + 1``.

    Raises DataError naming the file and row of the first bad row (unless ``skip_bad_rows``),
    or when no row gives an example.
    """
    row_tokens = seq_len + 1
    examples: list[Example] = []
    bad = 0
    for path in files:
        for row, value in iter_rows(path):
            try:
                made = _row_examples(value, kind, renderer)
                for ex in made:
                    if len(ex) > seq_len:
                        raise RowError(f"it is {len(ex):,} tokens, longer than a sequence (--seq-len {seq_len}): "
                                       "raise --seq-len, or shorten it")  # fmt: skip
                    if separator is not None and kind != PREFERENCE and separator in ex.tokens[1:].tolist():
                        raise RowError(f"its tokens hold the packing separator (token {separator}), which would split it")
            except RowError as e:
                if not skip_bad_rows:
                    raise DataError(f"{path}: row {row}: {e}: fix the row, or pass --skip-bad-rows to skip and count "
                                    "bad rows") from None  # fmt: skip
                bad += 1
                continue
            examples.extend(made)
    if not examples:
        raise DataError(f"{', '.join(map(str, files))}: no row gives an example ({bad} bad rows skipped)")
    if kind == PREFERENCE:  # a row each, chosen then rejected: the pair is a group of two rows
        tokens, trained = _one_per_row(examples, row_tokens, separator)
        return Packed(tokens, trained, row_tokens, len(examples) // 2, bad, 2)
    tokens, trained = pack(examples, row_tokens, separator)
    return Packed(tokens, trained, row_tokens, len(examples), bad, 1)


def _one_per_row(examples: Sequence[Example], row_tokens: int, separator: Optional[int]):
    pad = 0 if separator is None else separator
    tokens = np.full((len(examples), row_tokens), pad, np.int32)
    trained = np.zeros((len(examples), row_tokens), bool)
    for i, ex in enumerate(examples):
        tokens[i, : len(ex)] = ex.tokens
        trained[i, : len(ex)] = ex.trained
    return tokens.reshape(-1), trained.reshape(-1)


def _row_examples(value, kind: str, renderer: Renderer) -> list[Example]:
    """The examples of one row of format ``kind`` (two for a preference pair)."""
    if isinstance(value, RowError):
        raise value
    if not isinstance(value, dict):
        raise RowError(f"a row must be a JSON object, got {_short(value)}")
    if kind == MESSAGES:
        if "messages" not in value:
            raise RowError(f"no 'messages' (its fields: {', '.join(map(str, value)) or 'none'})")
        return [renderer.messages(value["messages"])]
    need = ("prompt", "chosen", "rejected") if kind == PREFERENCE else ("prompt", "completion")
    missing = [k for k in need if k not in value]
    if missing:
        raise RowError(f"no {', '.join(repr(k) for k in missing)} (its fields: {', '.join(map(str, value)) or 'none'})")
    if kind == PREFERENCE:
        return [renderer.completion(value["prompt"], value["chosen"]), renderer.completion(value["prompt"], value["rejected"])]
    return [renderer.completion(value["prompt"], value["completion"])]


def data_time(files: Sequence[Path]) -> datetime.datetime:
    """The newest modification time of the data files: ``strftime_now`` in training."""
    return datetime.datetime.fromtimestamp(max((os.stat(p).st_mtime for p in files), default=0))


def _rewritten_answer_end(prompt: str, turn: str, text: str) -> Optional[int]:
    """Where an answer ends in the whole ``text`` when the template writes it differently once
    a user message follows (Qwen3 drops the answer's ``<think>`` block there): the longest tail
    of the answer as written alone (``turn`` after ``prompt``) that follows the prompt in the
    whole text, if it is more than whitespace; None if there is none."""
    if not (turn.startswith(prompt) and text.startswith(prompt)):
        return None
    added, rest = turn[len(prompt) :], text[len(prompt) :]
    k = next((k for k in range(1, len(added)) if rest.startswith(added[k:])), None)
    if k is None or not added[k:].strip():
        return None
    return len(prompt) + len(added) - k
