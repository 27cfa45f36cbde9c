"""A run's tokens: text through the run's tokenizer, token files, or instruction, chat and
preference rows rendered and packed (:mod:`nnxscale.data.chat`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import numpy as np

from nnxscale.data import chat as chat
from nnxscale.data import text as text
from nnxscale.data import tokens as datalib
from nnxscale.errors import storage_error
from nnxscale.models import (
    is_pretrained_dir,
)  # fmt: skip
from nnxscale.training.config import ConfigError, TrainConfig
from nnxscale.training.rundir import write_atomic

#: A run directory's copy of the tokenizer it trains with (and ``sample`` decodes with).
TOKENIZER_FILE = "tokenizer.json"
#: Copied with it when the source has one: it names the end-of-text token (and may hold the chat template).
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
#: Copied with it when the source has one: the chat template as current transformers save it.
CHAT_TEMPLATE_FILE = chat.TEMPLATE_FILE


@dataclasses.dataclass(frozen=True)
class DataKind:
    """What a run's data is, found before the model is built (its loss depends on it).

    ``format``: text, messages, completion or preference (:func:`nnxscale.data.chat.record_format`);
    ``loss_on``: ``"completion"`` or ``"all"``; ``template``: the chat template beside the
    tokenizer, if any; ``packing``: the token after each example (rows, not text).
    """

    format: str = chat.TEXT
    loss_on: str = "all"
    template: Optional[chat.ChatTemplate] = None
    packing: Optional[int] = None

    @property
    def rows(self) -> bool:
        """Examples packed into rows, some targets IGNORED (their padding's, at least)."""
        return self.format != chat.TEXT


def data_kind(cfg: TrainConfig, tokenizer: Optional[text.TextTokenizer]) -> DataKind:
    """The :class:`DataKind` of ``cfg``'s data (it reads the first row of a JSON Lines or
    Parquet file). Raises ConfigError, one line each, for ``--objective dpo`` without
    preference pairs (or pairs without it) and ``--loss-on completion`` on text."""
    source = cfg.data.data
    if source is not None and source != text.STDLIB and text.is_text_source(source):
        text.read_corpus(source)  # a path that is not there says so (nothing is read), not "is text" below
    files = text.record_files(source) if text.is_text_source(source) else []
    fmt = chat.record_format(source, text.record_files) if files else chat.TEXT
    if cfg.objective == "dpo" and fmt != chat.PREFERENCE:
        raise ConfigError(f"--objective dpo trains on preference pairs: JSON Lines rows of prompt, chosen and rejected; "
                          f"the first row of {source} is {fmt}")  # fmt: skip
    if fmt == chat.PREFERENCE and cfg.objective != "dpo":
        raise ConfigError(f"{source} holds preference pairs (prompt, chosen, rejected): train on them with --objective dpo")
    loss_on = cfg.data.loss_on or ("all" if fmt == chat.TEXT else "completion")
    if fmt == chat.TEXT:
        if loss_on == "completion":
            raise ConfigError(f"--loss-on completion: {source or 'the corpus'} is text, with no prompt to leave out: its "
                              "JSON Lines rows need messages, or prompt and completion")  # fmt: skip
        return DataKind()
    directory = chat.template_directory(tokenizer)
    template = chat.ChatTemplate.find(directory, now=chat.data_time(files)) if directory is not None else None
    return DataKind(fmt, loss_on, template, chat.packing_separator(tokenizer, template))


def run_tokenizer(cfg: TrainConfig, run_dir) -> Optional[text.TextTokenizer]:
    """The tokenizer of a run, ``None`` for bytes: the run directory's own copy (kept since
    its first command), else ``--tokenizer``, else the ``tokenizer.json`` of an
    ``--init-from`` Hugging Face directory."""
    kept = Path(run_dir) / TOKENIZER_FILE
    if kept.is_file():
        return text.load_tokenizer(kept)
    if cfg.data.tokenizer is not None:
        return text.load_tokenizer(cfg.data.tokenizer)
    source = pretrained_source(cfg)
    if source is not None and (Path(source) / TOKENIZER_FILE).is_file():
        return text.load_tokenizer(source)
    return None


def pretrained_source(cfg: TrainConfig) -> Optional[str]:
    """The Hugging Face directory a run starts from: ``--init-from DIR``, or ``--model DIR``
    without ``--init-from`` (the directory's architecture and its weights)."""
    if cfg.model.init_from is not None:
        return cfg.model.init_from if is_pretrained_dir(cfg.model.init_from) else None
    return cfg.model.name if is_pretrained_dir(cfg.model.name) else None


def document_separator(cfg: TrainConfig, tokenizer: Optional[text.TextTokenizer], kind: DataKind = DataKind()) -> Optional[int]:
    """The token that ends each document of the run's data under ``--document-mask`` (``None``
    without it): the tokenizer's end-of-text token, or byte 0 for text read as bytes; for
    rows of examples, the packing separator (``kind.packing``).

    Raises ConfigError when the data has none: a tokenizer without an end-of-text token, or
    a token file without ``--tokenizer`` to say which id it is.
    """
    if not cfg.data.document_mask:
        return None
    if kind.rows:
        if kind.packing is None:
            raise ConfigError(
                f"--document-mask: the chat template writes every end-of-text token {tokenizer.path} has, so none can "
                "separate packed conversations: drop --document-mask"
            )
        return kind.packing
    if tokenizer is not None:
        if tokenizer.separator is None:
            raise ConfigError(
                f"--document-mask: tokenizer {tokenizer.path} has no end-of-text token (no eos_token in a "
                "tokenizer_config.json beside it, none of <|endoftext|>, <|end_of_text|>, </s>, <eos>), so its "
                "documents are joined without a separator: drop --document-mask"
            )
        return tokenizer.separator
    if text.is_text_source(cfg.data.data):
        return text.SEPARATOR
    raise ConfigError(
        f"--document-mask: token file {cfg.data.data} does not say which token ends a document: give the "
        "tokenizer it was made with (--tokenizer tokenizer.json), whose end-of-text token separates its documents"
    )


def load_data(cfg: TrainConfig, tokenizer: Optional[text.TextTokenizer], vocab_size: int, kind: DataKind = DataKind()) -> datalib.TokenData:
    """The run's token stream, checked against the model's vocabulary.

    Raises ConfigError, in one line each: a tokenizer with more tokens than the model; text
    data without a tokenizer for a model that is not byte-level (vocabulary 256); a token
    file with ids outside the vocabulary.
    """
    model, source = cfg.model.name, cfg.data.data
    if tokenizer is not None and tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer.path} has {tokenizer.vocab_size:,} tokens, more than {model}'s vocabulary of "
            f"{vocab_size:,}: use the model's own tokenizer, or a model with a larger vocabulary"
        )
    is_text = text.is_text_source(source)
    if is_text and tokenizer is None and vocab_size != text.BYTE_VOCAB:
        raise ConfigError(
            f"{model} has a vocabulary of {vocab_size:,}, not bytes ({text.BYTE_VOCAB}): text data needs its "
            "tokenizer (--tokenizer tokenizer.json), or tokenize it once with nnxscale tokenize"
        )
    if kind.rows:
        tokens = load_examples(cfg, tokenizer, kind)
    else:
        records = text.Records(cfg.data.text_field, cfg.data.skip_bad_rows)
        tokens = datalib.load_tokens(source, tokenizer=tokenizer if is_text else None, records=records)
    if tokens.vocab_size > vocab_size:
        raise ConfigError(
            f"data {source} holds token id {tokens.vocab_size - 1:,}, outside {model}'s vocabulary of {vocab_size:,} "
            f"(ids 0 to {vocab_size - 1:,}): tokenize it with the model's tokenizer"
        )
    return tokens


def load_examples(cfg: TrainConfig, tokenizer: Optional[text.TextTokenizer], kind: DataKind) -> datalib.TokenData:
    """Rows of messages, prompt/completion or preference pairs, rendered and packed into
    rows of ``seq_len + 1`` tokens (:func:`nnxscale.data.chat.load_examples`)."""
    tok = text.ByteTokenizer() if tokenizer is None else tokenizer
    files = text.record_files(cfg.data.data)
    packed = chat.load_examples(files, chat.Renderer(tok, kind.template, kind.loss_on), kind=kind.format,
                                seq_len=cfg.data.seq_len, separator=kind.packing, skip_bad_rows=cfg.data.skip_bad_rows)  # fmt: skip
    tokens = packed.tokens.astype(tok.dtype if np.iinfo(tok.dtype).max >= packed.tokens.max(initial=0) else np.int32)
    tokens.flags.writeable = False
    rows = len(tokens) // packed.row_tokens
    unit = {chat.MESSAGES: "conversations", chat.COMPLETION: "prompts and completions", chat.PREFERENCE: "preference pairs"}
    skipped = f", {packed.bad_rows} bad rows skipped" if packed.bad_rows else ""
    share = float(np.mean(packed.trained)) if len(packed.trained) else 0.0
    if kind.packing is None:
        between = "nothing between examples"
    else:
        between = (tok.token_name(kind.packing) if hasattr(tok, "token_name") else f"byte {kind.packing}") + " after each example"
    description = (f"{', '.join(map(str, files))}: {packed.examples:,} {unit[kind.format]}{skipped} in {rows:,} rows of "
                   f"{packed.row_tokens} tokens ({between}), {share:.1%} of the tokens trained (--loss-on {kind.loss_on}; "
                   f"{tok.description})")  # fmt: skip
    mark = np.concatenate([tokens.astype(np.int64), packed.trained.astype(np.int64)])
    return datalib.TokenData(tokens, tok.vocab_size, description, datalib.fingerprint(mark), packed.trained,
                             packed.row_tokens, packed.group)  # fmt: skip


def keep_tokenizer(tokenizer: text.TextTokenizer, run_dir: Path) -> None:
    """Copy the tokenizer (its tokenizer_config.json and chat template) into the run directory, once."""
    if tokenizer.path == run_dir / TOKENIZER_FILE:
        return
    config = tokenizer.path.with_name(TOKENIZER_CONFIG_FILE)
    template = tokenizer.path.with_name(CHAT_TEMPLATE_FILE)
    for source, name in ((config, TOKENIZER_CONFIG_FILE), (template, CHAT_TEMPLATE_FILE),
                         (tokenizer.path, TOKENIZER_FILE)):  # tokenizer.json last  # fmt: skip
        if source.is_file():
            try:
                content = source.read_text()
            except OSError as e:
                raise storage_error("reading", source, e) from None
            write_atomic(run_dir / name, content)
