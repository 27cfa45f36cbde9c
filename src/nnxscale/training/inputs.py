"""A run's tokens: text through the run's tokenizer, or token files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

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
#: Copied with it when the source has one: it names the end-of-text token.
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


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


def document_separator(cfg: TrainConfig, tokenizer: Optional[text.TextTokenizer]) -> Optional[int]:
    """The token that ends each document of the run's data under ``--document-mask`` (``None``
    without it): the tokenizer's end-of-text token, or byte 0 for text read as bytes.

    Raises ConfigError when the data has none: a tokenizer without an end-of-text token, or
    a token file without ``--tokenizer`` to say which id it is.
    """
    if not cfg.data.document_mask:
        return None
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


def load_data(cfg: TrainConfig, tokenizer: Optional[text.TextTokenizer], vocab_size: int) -> datalib.TokenData:
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
    records = text.Records(cfg.data.text_field, cfg.data.skip_bad_rows)
    tokens = datalib.load_tokens(source, tokenizer=tokenizer if is_text else None, records=records)
    if tokens.vocab_size > vocab_size:
        raise ConfigError(
            f"data {source} holds token id {tokens.vocab_size - 1:,}, outside {model}'s vocabulary of {vocab_size:,} "
            f"(ids 0 to {vocab_size - 1:,}): tokenize it with the model's tokenizer"
        )
    return tokens


def keep_tokenizer(tokenizer: text.TextTokenizer, run_dir: Path) -> None:
    """Copy the tokenizer (and its tokenizer_config.json) into the run directory, once."""
    if tokenizer.path == run_dir / TOKENIZER_FILE:
        return
    config = tokenizer.path.with_name(TOKENIZER_CONFIG_FILE)
    for source, name in ((config, TOKENIZER_CONFIG_FILE), (tokenizer.path, TOKENIZER_FILE)):  # tokenizer.json last
        if source.is_file():
            try:
                content = source.read_text()
            except OSError as e:
                raise storage_error("reading", source, e) from None
            write_atomic(run_dir / name, content)
