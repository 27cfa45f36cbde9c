"""Text -> token ids and back: the text corpora nnxscale reads, tokenizers, ``nnxscale tokenize``.

Corpora (:func:`read_corpus`):

- ``None`` or ``"stdlib"``: the default corpus, the running Python's own standard library
  source (every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except ``site-packages``
  and ``__pycache__``), about 30 MB of real text on every machine, nothing downloaded.
- a text file, or a directory (every regular file recursively, in path order; empty files
  and files containing a NUL byte, taken for binary, are skipped).
- JSON Lines (``.jsonl``, ``.jsonl.gz``, ``.json``: one JSON object per line) and Parquet
  (``.parquet``, read with ``pyarrow``) files, alone or in a directory: each row is a
  document, its text in a field (:class:`Records`; ``text`` by default). Read a row group or
  a line at a time: memory stays bounded whatever the file's size.

Each other file is one document. Tokenizers (:func:`load_tokenizer`), one interface:

- :class:`ByteTokenizer`: the bytes are the tokens (vocabulary 256), documents joined by
  byte 0 (:data:`SEPARATOR`), which never occurs in text. Byte-level models' text.
- :class:`TextTokenizer`: a Hugging Face ``tokenizers`` tokenizer read from a local
  ``tokenizer.json``; nothing is downloaded, ever. Each document is encoded with the
  tokenizer's own special tokens (Llama 3's adds ``<|begin_of_text|>``, GPT-2's none) and
  documents are joined by its end-of-text token (:attr:`TextTokenizer.separator`).

Files are encoded in groups of about 4 MiB, each group's documents in parallel on every
core (``tokenizers`` runs a batch on a thread pool; ``RAYON_NUM_THREADS`` limits it). A
corpus of one huge file is one document, encoded on one core: split it into files.

:func:`tokenize` writes a corpus's tokens once, as a token file ``train`` reads: ``.bin``
(uint16, nanoGPT's layout: vocabularies up to 65,536) or ``.npy`` (uint16 when the
vocabulary fits, else int32: Llama 3's 128,256). This module imports no jax: ``nnxscale
tokenize`` needs no devices.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Optional, Union

import numpy as np
import tokenizers

from nnxscale.errors import DataError, StorageError, storage_error
from nnxscale.progress import ProgressBar

#: Token placed between two documents (files) of byte-level text: byte 0, never in text.
SEPARATOR = 0

#: Vocabulary of byte-level tokens.
BYTE_VOCAB = 256

#: Most token ids a ``.bin`` file (uint16) holds.
UINT16_VOCAB = 1 << 16

#: Source name of the default corpus (also used when the source is ``None``).
STDLIB = "stdlib"

#: Token ids of a ``.npy`` token file or of tokens in memory: the narrowest that holds them.
_DTYPES = ((BYTE_VOCAB, np.uint8), (UINT16_VOCAB, np.uint16), (2**31, np.int32))

#: End-of-text tokens of well-known tokenizers, the separator when no tokenizer_config.json says.
_KNOWN_SEPARATORS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")

TextSource = Union[str, os.PathLike, None]


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned/int32 dtype that holds ids ``0 .. vocab_size - 1``."""
    for limit, dtype in _DTYPES:
        if vocab_size <= limit:
            return np.dtype(dtype)
    raise DataError(f"a vocabulary of {vocab_size:,} tokens does not fit int32 token ids")


# ---------------------------------------------------------------------------------------
# tokenizers


class ByteTokenizer:
    """Text as its UTF-8 bytes: vocabulary 256, documents joined by byte 0."""

    vocab_size = BYTE_VOCAB
    separator: Optional[int] = SEPARATOR
    dtype = np.dtype(np.uint8)
    description = f"vocab {BYTE_VOCAB}"
    group_bytes = 1  # nothing to parallelize: one file at a time, so max_tokens stops early

    def encode_batch(self, documents: Sequence[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(d, dtype=np.uint8) for d in documents]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


class TextTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from a local ``tokenizer.json``.

    Attributes:
      path: the ``tokenizer.json`` file.
      vocab_size: its largest token id + 1, added (special) tokens included.
      separator: the id placed between documents: the ``eos_token`` of a
        ``tokenizer_config.json`` beside the file, else the first of ``<|endoftext|>``,
        ``<|end_of_text|>``, ``</s>``, ``<eos>`` it has, else ``None`` (documents are joined
        as they are).
      dtype: uint16 when the vocabulary fits, else int32.
    """

    group_bytes = 4 << 20

    def __init__(self, path):
        path = Path(path).expanduser()
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(
                f"no tokenizer at {path}: give a tokenizer.json file or a directory holding one "
                "(tokenizers are read from local files, never downloaded)"
            )

        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the library raises plain Exceptions for malformed files
            raise DataError(f"{file} is not a tokenizer.json of the tokenizers library ({_first_line(e)})") from None
        self.path = file
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        if self.vocab_size == 0:
            raise DataError(f"{file} has an empty vocabulary")
        self.dtype = token_dtype(self.vocab_size)
        self.separator = self._find_separator(file, vocab)
        sep = "no separator" if self.separator is None else f"separator {self._tokenizer.id_to_token(self.separator)}"
        self.description = f"tokenizer {file}, vocab {self.vocab_size:,}, {sep}"

    @staticmethod
    def _find_separator(file: Path, vocab: dict[str, int]) -> Optional[int]:
        config = file.with_name("tokenizer_config.json")
        if config.is_file():
            try:
                eos = json.loads(config.read_text()).get("eos_token")
            except (OSError, ValueError, AttributeError):
                eos = None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str) and eos in vocab:
                return vocab[eos]
        return next((vocab[t] for t in _KNOWN_SEPARATORS if t in vocab), None)

    def encode_batch(self, documents: Sequence[bytes]) -> list[np.ndarray]:
        # A file that is not valid UTF-8 keeps its readable parts (U+FFFD for the rest).
        texts = [d.decode("utf-8", errors="replace") for d in documents]
        return [np.asarray(e.ids, dtype=self.dtype) for e in self._tokenizer.encode_batch_fast(texts)]

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def encode_plain(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids without the special tokens the tokenizer adds (a chat template
        writes its own; special tokens written in the text are still read as such)."""
        return [list(e.ids) for e in self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)]

    def token_name(self, token_id: int) -> str:
        """The text of token ``token_id`` (``"<|eot_id|>"``)."""
        return self._tokenizer.id_to_token(int(token_id)) or f"token {token_id}"

    def token_id(self, token: str) -> Optional[int]:
        """The id of ``token`` (e.g. ``"<|eot_id|>"``), ``None`` when the vocabulary lacks it."""
        return self._tokenizer.token_to_id(token)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


Tokenizer = Union[ByteTokenizer, TextTokenizer]


def load_tokenizer(path) -> TextTokenizer:
    """The tokenizer of ``path``: a ``tokenizer.json``, or a directory holding one.

    Raises DataError naming the path when there is none, or it cannot be read.
    """
    return path if isinstance(path, TextTokenizer) else TextTokenizer(path)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


# ---------------------------------------------------------------------------------------
# corpora


#: File suffixes read as records (one document per row) rather than as one text document.
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")


@dataclasses.dataclass(frozen=True)
class Records:
    """How JSON Lines and Parquet files give their documents: the text of each row is in
    ``text_field``; a bad row (not JSON, no such field, not a string) is an error naming the
    file and row, or with ``skip_bad_rows`` is skipped and counted."""

    text_field: str = "text"
    skip_bad_rows: bool = False


def is_record_file(path: Path) -> bool:
    return path.name.lower().endswith(RECORD_SUFFIXES)


def open_parquet(path: Path):
    """A ``pyarrow.parquet.ParquetFile``; DataError naming the file when pyarrow is missing or
    the file is not Parquet."""
    try:
        import pyarrow.parquet as pq  # the parquet extra: optional
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow (or nnxscale[parquet])") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def _record_documents(path: Path, records: Records, stats: "EncodeStats", at: Callable[[int], None]) -> Iterator[bytes]:
    """The documents of one JSON Lines or Parquet file, a row at a time, as UTF-8 bytes.
    ``at(n)``: about ``n`` of the file's bytes are read so far (for a progress bar: what a
    compressed file holds is more than its size)."""
    field = records.text_field

    def bad(row: int, what: str) -> None:
        if not records.skip_bad_rows:
            raise DataError(f"{path}: row {row}: {what}: fix the row, or pass --skip-bad-rows to skip and count bad rows")
        stats.bad_rows += 1

    if path.name.lower().endswith(".parquet"):
        table = open_parquet(path)
        if field not in table.schema_arrow.names:
            raise DataError(f"{path}: no column {field!r} (columns: {', '.join(table.schema_arrow.names)}): "
                            "choose one with --text-field")  # fmt: skip
        row, rows, size = 0, max(table.metadata.num_rows, 1), path.stat().st_size
        for batch in table.iter_batches(columns=[field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                if isinstance(value, str):
                    yield value.encode("utf-8")
                else:
                    bad(row, f"{field!r} is {type(value).__name__}, not text")
            at(size * row // rows)
        return
    try:
        with open(path, "rb") as raw:
            binary = gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw
            with io.TextIOWrapper(binary, encoding="utf-8") as f:
                yield from _json_lines(f, raw, field, bad, at)
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: cannot be read as UTF-8 JSON Lines ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise storage_error("reading", path, e) from None


def _json_lines(f, raw, field: str, bad: Callable[[int, str], None], at: Callable[[int], None]) -> Iterator[bytes]:
    """The ``field`` of every row of the JSON Lines text ``f`` (read from the file ``raw``)."""
    for row, line in enumerate(f, 1):
        if row % 256 == 0:
            at(raw.tell())  # the compressed bytes, for a .gz
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as e:
            bad(row, f"not JSON ({e})")
            continue
        if not isinstance(value, dict) or field not in value:
            bad(row, f"no field {field!r} (choose one with --text-field)")
        elif not isinstance(value[field], str):
            bad(row, f"{field!r} is {type(value[field]).__name__}, not text")
        else:
            yield value[field].encode("utf-8")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Text files read as documents, in this order.

    ``what`` names it in descriptions (``"directory /data/books"``); ``unit`` counts its
    documents (``".py files"``); ``single``: one text file given as the source, which must
    be text (a directory skips empty and binary files instead); ``empty``: the error when no
    file is usable.
    """

    files: tuple[Path, ...]
    what: str
    unit: str
    empty: str
    single: bool = False
    records: Records = Records()

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)


def stdlib_root() -> Path:
    """Directory of the running Python's standard library (the default corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The default corpus: the stdlib's ``*.py`` files, sorted by relative path."""
    root = stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "__pycache__" in rel.parts or not path.is_file():
            continue
        files.append(rel)
    return [root / rel for rel in sorted(files, key=lambda p: p.as_posix())]


def record_files(source: TextSource) -> list[Path]:
    """The JSON Lines and Parquet files of a source (a record file, or those in a directory), in order."""
    if source is None or source == STDLIB:
        return []
    path = Path(source).expanduser()
    if path.is_dir():
        return [f for f in read_corpus(path).files if is_record_file(f)]
    return [path] if path.is_file() and is_record_file(path) else []


def is_text_source(source: TextSource) -> bool:
    """Whether ``load_tokens`` reads ``source`` as text (not a ``.bin``/``.npy`` token file)."""
    return source is None or source == STDLIB or Path(source).suffix.lower() not in (".bin", ".npy")


def read_corpus(source: TextSource, records: Records = Records()) -> Corpus:
    """The documents of a text source (see the module docstring); nothing is read yet.
    ``records``: how JSON Lines and Parquet files give their documents.

    Raises DataError for a path that does not exist.
    """
    if source is None or (isinstance(source, str) and source == STDLIB):
        root = stdlib_root()
        empty = (f"no Python source files under {str(root)!r}: this Python ships no stdlib sources; "
                 "pass a text file or a directory instead")  # fmt: skip
        return Corpus(tuple(stdlib_files()), f"stdlib corpus {root}", ".py files", empty)
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data source {str(path)!r} does not exist: give an existing file or directory, or 'stdlib'")
    if not path.is_dir():
        if is_record_file(path):
            return Corpus((path,), f"file {path}", "rows", f"{str(path)!r} has no row with text in {records.text_field!r}",
                          records=records)  # fmt: skip
        return Corpus((path,), f"text file {path}", "", f"text file {str(path)!r} is empty: give a file with text in it",
                      single=True)  # fmt: skip
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for name in filenames:
            full = Path(dirpath) / name
            if full.is_file():
                files.append(full)
    files.sort(key=lambda p: p.relative_to(path).as_posix())
    empty = (f"directory {str(path)!r} has no usable text file ({len(files)} files, all empty or binary): "
             "put text files in it, or pass a .bin/.npy token file")  # fmt: skip
    unit = "documents" if any(is_record_file(f) for f in files) else "text files"  # rows count as documents
    return Corpus(tuple(files), f"directory {path}", unit, empty, records=records)


@dataclasses.dataclass
class EncodeStats:
    """What encoding a corpus has done so far."""

    used: int = 0  # documents encoded
    skipped: int = 0  # empty or binary files
    bad_rows: int = 0  # JSON Lines or Parquet rows skipped (--skip-bad-rows)
    text_bytes: int = 0  # bytes of the documents encoded
    read_bytes: int = 0  # bytes read, skipped files included
    tokens: int = 0

    def files_text(self, corpus: Corpus) -> str:
        """``"1790 .py files (2 empty or binary skipped)"``; empty for a single file."""
        if corpus.single:
            return ""
        skipped = f" ({self.skipped} empty or binary skipped)" if self.skipped else ""
        if self.bad_rows:
            skipped += f" ({self.bad_rows} bad rows skipped)"
        return f": {self.used} {corpus.unit}{skipped}"


def encode_corpus(corpus: Corpus, tokenizer: Tokenizer, stats: EncodeStats) -> Iterator[np.ndarray]:
    """The corpus's tokens (``tokenizer.dtype``), a group of documents at a time, in order.

    Documents are joined by ``tokenizer.separator`` (when it has one). Files are read
    lazily: a caller that stops iterating stops the reading. ``stats`` is updated as it goes.

    Raises DataError for a single text file that is empty or binary, and for a corpus
    with no usable document.
    """
    sep = None if tokenizer.separator is None else np.array([tokenizer.separator], dtype=tokenizer.dtype)
    pending: list[bytes] = []

    def encoded() -> np.ndarray:
        parts = []
        for tokens in tokenizer.encode_batch(pending):
            if stats.used and sep is not None:
                parts.append(sep)
            parts.append(tokens)
            stats.used += 1
        pending.clear()
        out = np.concatenate(parts) if parts else np.zeros(0, tokenizer.dtype)
        stats.tokens += len(out)
        return out

    def documents() -> Iterator[bytes]:
        """Every usable document, in order: each row of a record file, each other file whole."""
        for path in corpus.files:
            if is_record_file(path):
                start = stats.read_bytes

                def at(n: int) -> None:
                    stats.read_bytes = start + n

                for data in _record_documents(path, corpus.records, stats, at):
                    if data:
                        yield data
                at(path.stat().st_size)
                continue
            try:
                data = path.read_bytes()
            except OSError as e:
                raise storage_error("reading", path, e) from None
            stats.read_bytes += len(data)
            if not data or b"\0" in data:
                if corpus.single and not data:
                    raise DataError(corpus.empty)
                if corpus.single:
                    raise DataError(
                        f"file {str(path)!r} contains NUL bytes, so it is not text: "
                        "save tokens as .bin (uint16) or .npy, or pass a text file"
                    )
                stats.skipped += 1
                continue
            yield data

    size = 0
    for data in documents():
        pending.append(data)
        stats.text_bytes += len(data)
        size += len(data)
        if size >= tokenizer.group_bytes:
            yield encoded()
            size = 0
    if pending:
        yield encoded()
    if not stats.used:
        raise DataError(corpus.empty)


# ---------------------------------------------------------------------------------------
# nnxscale tokenize


def tokenize(tokenizer, source: TextSource, out, *, progress: bool = True, records: Records = Records()) -> dict:
    """Encode a text corpus once into a token file that ``train`` reads.

    Args:
      tokenizer: a ``tokenizer.json`` (or a directory holding one), or a :class:`TextTokenizer`.
      source: a text file, a directory, or ``"stdlib"`` (see :func:`read_corpus`).
      out: ``FILE.bin`` (uint16: vocabularies up to 65,536) or ``FILE.npy`` (uint16 when the
        vocabulary fits, else int32). Written whole or not at all (a temporary file, then a
        rename); an existing file is replaced.
      progress: draw a progress bar (bytes read, tokens, speed).
      records: how JSON Lines and Parquet files give their documents (:class:`Records`).

    Returns ``{"path", "tokens", "documents", "skipped", "bad_rows", "bytes", "dtype",
    "vocab_size", "seconds"}``. A bad row (without ``records.skip_bad_rows``) stops it with
    nothing written.

    Raises DataError for a vocabulary the format cannot hold, an unknown suffix, or a
    corpus with no text.
    """
    tok = load_tokenizer(tokenizer)
    out = Path(out).expanduser()
    suffix = out.suffix.lower()
    if suffix == ".bin":
        if tok.vocab_size > UINT16_VOCAB:
            raise DataError(
                f"{tok.path} has {tok.vocab_size:,} tokens, more than a .bin token file holds "
                f"(uint16: {UINT16_VOCAB:,}): write --out {out.with_suffix('.npy')} (int32) instead"
            )
        dtype = np.dtype(np.uint16)
    elif suffix == ".npy":
        dtype = np.dtype(np.uint16) if tok.vocab_size <= UINT16_VOCAB else np.dtype(np.int32)
    else:
        raise DataError(f"--out {out}: a token file is .bin (uint16) or .npy (uint16 or int32)")
    corpus = read_corpus(source, records)
    total = corpus.total_bytes()
    if not out.parent.is_dir():
        raise DataError(f"--out {out}: directory {out.parent} does not exist")
    raw = out.with_name(out.name + ".tokens.tmp")
    stats = EncodeStats()
    started = time.perf_counter()
    bar = ProgressBar(progress, "tokenize", total, in_bytes=True)
    try:
        with open(raw, "wb") as f:
            for tokens in encode_corpus(corpus, tok, stats):
                f.write(tokens.astype(dtype, copy=False).tobytes())
                bar.update(stats.read_bytes, f"{stats.tokens:,} tokens, {stats.used:,} documents")
        bar.close()
        if suffix == ".bin":
            os.replace(raw, out)
        else:
            _raw_to_npy(raw, out, dtype, stats.tokens)
    except StorageError:  # a corpus file that cannot be read: already named
        raise
    except OSError as e:
        raise storage_error("writing", out, e) from None
    finally:
        bar.close()
        raw.unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    return {"path": str(out), "tokens": stats.tokens, "documents": stats.used, "skipped": stats.skipped, "bad_rows": stats.bad_rows,
            "bytes": stats.text_bytes, "dtype": str(dtype), "vocab_size": tok.vocab_size,
            "seconds": seconds}  # fmt: skip


def _raw_to_npy(raw: Path, out: Path, dtype: np.dtype, count: int) -> None:
    """Write ``count`` raw ``dtype`` tokens from ``raw`` as the ``.npy`` file ``out`` (atomic)."""
    tmp = out.with_name(out.name + ".tmp")
    try:
        target = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(count,))
        source = np.memmap(raw, dtype=dtype, mode="r") if count else np.zeros(0, dtype)
        step = 16 << 20
        for start in range(0, count, step):
            target[start : start + step] = source[start : start + step]
        target.flush()
        del target, source
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
