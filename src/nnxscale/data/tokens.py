"""Token data for training: a source -> one token stream -> each process's batches.

Sources (:func:`load_tokens`):

- text: ``None`` or ``"stdlib"`` (the default corpus, the running Python's standard library
  source), a text file, or a directory of text files, each file one document
  (``nnxscale.data.text``). Its tokens are its bytes (vocabulary 256, documents joined by byte 0),
  or with a tokenizer (``tokenizer.json``) the tokenizer's ids, documents joined by its
  end-of-text token.
- ``.bin`` (uint16, nanoGPT's layout) or ``.npy`` (1-D integer array) token files, memory
  mapped; vocabulary = largest token + 1 unless given. ``nnxscale tokenize`` writes them.

Batches (:func:`train_batches`): the train stream is cut into non-overlapping windows of
``seq_len + 1`` tokens (``inputs = w[:-1]``, ``targets = w[1:]``), the window order is a
grain shuffle that changes every epoch and repeats forever, and the window sequence is cut
into global batches of ``global_batch_size`` windows. Every process walks the same
sequence of global batches and reads only its own rows of each: the rows its devices hold
under the batch sharding (:func:`batch_rows`), or without a sharding, rows
``[p * B/P, (p + 1) * B/P)`` for process ``p`` of ``P``. :func:`to_global` puts each row
where the sharding wants it, so the global batch is the same on any number of processes
and any mesh, and a state saved after step ``k`` resumes at step ``k + 1`` whatever the
process count. Tokens are gathered per local batch, only the rows this process needs: a
memory-mapped ``.bin`` is never read in full by the batches (:func:`load_tokens` scans it
once for its token range and hashes it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any, Optional, Union

import grain
import jax
import numpy as np

from nnxscale.data import text as text
from nnxscale.data.chat import IGNORED
from nnxscale.errors import DataError

TokenSource = Union[str, os.PathLike, None]

_KEPT_DTYPES = (np.uint8, np.uint16, np.int32)  # token dtypes used as stored (memory mapped)
_FULL_HASH_BYTES = 256 << 20  # streams up to this size are hashed in full, larger ones sampled
_SAMPLE_CHUNKS = 256
_SAMPLE_BYTES = 1 << 20

# Prefetch for the training iterator. Gathering one local batch is a few dozen numpy slices,
# so a deep buffer only adds work after a resume; measured on 2 CPU cores (seq_len 256,
# batch 32) two threads and a buffer of 8 keep up with the default of 16 threads and 500.
_READ_OPTIONS = dict(num_threads=2, prefetch_buffer_size=8)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenData:
    """A token stream and what it is.

    Attributes:
      tokens: 1-D read-only array of token ids, ``uint8`` (bytes), ``uint16`` (``.bin``) or
        ``int32``; may be a memory map.
      vocab_size: number of token ids (256 for bytes, the tokenizer's for tokenized text).
      description: what was read, e.g. ``"stdlib corpus /usr/lib/python3.11: 1790 .py files,
        31,525,224 bytes -> 31,527,013 tokens (vocab 256)"``.
      fingerprint: 16 hex digits of BLAKE2b over dtype, length and tokens, so a resumed run
        can tell that its data changed. Streams over 256 MiB are hashed from 256 evenly
        spaced 1 MiB samples plus the tail, so loading a huge file stays fast.
      trained: for instruction, chat and preference data (:mod:`nnxscale.data.chat`): bool,
        like ``tokens``: token ``i`` is a target the loss trains; the others' targets are
        :data:`~nnxscale.data.chat.IGNORED`. ``None``: every token is.
      row_tokens: for such data, the stream is rows of this many tokens (``seq_len + 1``),
        each holding whole examples; windows and the validation split follow the rows.
      group: rows that belong together (2: a preference pair, chosen then rejected), kept
        together in every batch and split.
    """

    tokens: np.ndarray
    vocab_size: int
    description: str
    fingerprint: str
    trained: Optional[np.ndarray] = None
    row_tokens: Optional[int] = None
    group: int = 1

    def __len__(self) -> int:
        return len(self.tokens)


# ---------------------------------------------------------------------------------------
# sources


def load_tokens(
    source: TokenSource = None,
    *,
    max_tokens: Optional[int] = None,
    vocab_size: Optional[int] = None,
    tokenizer=None,
    records: Optional[text.Records] = None,
) -> TokenData:
    """Read a source into one 1-D token stream.

    Args:
      source: ``None`` or ``"stdlib"`` (default corpus), a text file, a directory of text
        files, a ``.bin`` (uint16) or a ``.npy`` (integer) token file. See the module
        docstring.
      max_tokens: keep only the first ``max_tokens`` tokens (text sources stop reading
        files once they have enough).
      vocab_size: the vocabulary of a token file when it is known (e.g. 50257 for GPT-2
        BPE); default: largest token + 1.
      tokenizer: for text: a ``tokenizer.json`` (or a directory holding one, or a loaded
        ``TextTokenizer``); ``None`` reads bytes (vocabulary 256). Token files ignore it.
      records: how JSON Lines and Parquet files give their documents
        (:class:`nnxscale.data.text.Records`: the text field, whether to skip bad rows).

    Raises:
      DataError: missing path, a directory with no usable text file, an empty file, a
        binary file given as text, a token file of an unsupported dtype or shape, or a
        tokenizer that cannot be read.
    """
    if max_tokens is not None and max_tokens < 1:
        raise DataError(f"max_tokens={max_tokens}: give a positive number of tokens, or None for all")
    if not text.is_text_source(source):
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"data source {str(path)!r} does not exist: give an existing file or directory, or 'stdlib'")
        return _load_token_file(path, max_tokens, vocab_size)
    corpus = text.read_corpus(source, records or text.Records())
    tok = text.ByteTokenizer() if tokenizer is None else text.load_tokenizer(tokenizer)
    stats = text.EncodeStats()
    pieces, count = [], 0
    for tokens in text.encode_corpus(corpus, tok, stats):
        pieces.append(tokens)
        count += len(tokens)
        if max_tokens is not None and count >= max_tokens:
            break
    tokens = np.concatenate(pieces)[:max_tokens]
    tokens.flags.writeable = False
    description = (
        f"{corpus.what}{stats.files_text(corpus)}, {stats.text_bytes:,} bytes -> {len(tokens):,} tokens "
        f"({tok.description})"
    )
    return TokenData(tokens, tok.vocab_size, description, fingerprint(tokens))


def _load_token_file(path: Path, max_tokens: Optional[int], vocab_size: Optional[int]) -> TokenData:
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"token file {str(path)!r} is empty: write tokens into it, or pick another file")
    if path.suffix.lower() == ".bin":
        if size % 2:
            raise DataError(
                f"token file {str(path)!r} has {size} bytes, an odd number, so it is not uint16 tokens: "
                "write .bin files as np.uint16 (nanoGPT layout), or use .npy"
            )
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    else:
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:  # object arrays, corrupt headers
            raise DataError(f"cannot read token file {str(path)!r} ({e}): save a 1-D integer array with np.save") from None
        if not isinstance(tokens, np.ndarray):
            raise DataError(f"token file {str(path)!r} is not a single array: save a 1-D integer array with np.save")
        if tokens.ndim != 1:
            raise DataError(
                f"token file {str(path)!r} holds an array of shape {tokens.shape}: "
                "save the tokens as one 1-D stream (arr.reshape(-1))"
            )
        if tokens.dtype.kind not in "iu":
            raise DataError(
                f"token file {str(path)!r} has dtype {tokens.dtype}, not an integer type: "
                "save token ids as uint16 or int32"
            )
    if len(tokens) == 0:
        raise DataError(f"token file {str(path)!r} holds no tokens: write tokens into it, or pick another file")
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0:
        raise DataError(f"token file {str(path)!r} holds a negative token id ({low}): token ids start at 0")
    if tokens.dtype.type not in _KEPT_DTYPES:
        if high >= 2**31:
            raise DataError(f"token file {str(path)!r} holds token id {high}, too large for int32")
        tokens = tokens.astype(np.int32)  # other integer dtypes: converted in memory
        tokens.flags.writeable = False
    if vocab_size is None:
        vocab_size = high + 1
    elif high >= vocab_size:
        raise DataError(f"token file {str(path)!r} holds token id {high}, outside vocab_size={vocab_size}")
    description = f"token file {path}: {size:,} bytes, {tokens.dtype} -> {len(tokens):,} tokens (vocab {vocab_size})"
    return TokenData(tokens, int(vocab_size), description, fingerprint(tokens))


def fingerprint(tokens: np.ndarray) -> str:
    """16 hex digits identifying a token stream (dtype, length, content; see TokenData)."""
    tokens = np.ascontiguousarray(tokens)
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{tokens.dtype.str}:{len(tokens)}:".encode())
    raw = tokens.view(np.uint8)
    if raw.nbytes <= _FULL_HASH_BYTES:
        h.update(raw)
    else:
        step = raw.nbytes // _SAMPLE_CHUNKS
        for start in range(0, step * _SAMPLE_CHUNKS, step):
            h.update(raw[start : start + _SAMPLE_BYTES])
        h.update(raw[-_SAMPLE_BYTES:])
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# split


def split(
    tokens: Union[TokenData, np.ndarray], val_fraction: float, *, seq_len: Optional[int] = None
) -> tuple[np.ndarray, np.ndarray]:
    """Split a stream into ``(train, val)``: val is the last ``val_fraction`` of the stream.

    The validation tokens are the contiguous tail, ``floor(len * val_fraction)`` tokens,
    disjoint from train (both are views, nothing is copied). ``val_fraction=0`` gives an
    empty val. With ``seq_len``, checks that train (and val, unless it is empty by choice)
    holds at least one window of ``seq_len + 1`` tokens.
    """
    name = tokens.description if isinstance(tokens, TokenData) else "token stream"
    stream = _stream(tokens)
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction}: give a fraction in [0, 1), e.g. 0.05, or 0 for no validation")
    n_val = int(len(stream) * val_fraction)
    if isinstance(tokens, TokenData) and tokens.row_tokens:  # whole groups of rows
        unit = tokens.row_tokens * tokens.group
        n_val = int(len(stream) // unit * val_fraction) * unit
    train, val = stream[: len(stream) - n_val], stream[len(stream) - n_val :]
    if seq_len is not None:
        window = seq_len + 1
        if len(train) < window or (val_fraction > 0 and len(val) < window):
            raise DataError(
                f"{name}: {len(stream):,} tokens split into {len(train):,} train and {len(val):,} validation "
                f"(val_fraction={val_fraction}), too few for one sequence of seq_len+1={window} tokens in each: "
                "use more data, a shorter seq_len or a different val_fraction"
            )
    return train, val


# ---------------------------------------------------------------------------------------
# batches


class BatchIterator:
    """This process's local training batches, forever; resumable.

    ``next(it)`` -> ``{"inputs": int32 (B/P, T), "targets": int32 (B/P, T)}`` (a target the
    loss does not train is :data:`~nnxscale.data.chat.IGNORED`).
    ``get_state()`` is a JSON-serializable dict; ``set_state(state)`` on an iterator built
    with the same tokens, ``seq_len``, ``global_batch_size`` and ``seed`` (any process count)
    continues with the batch after the one the state was taken at.
    """

    def __init__(self, dataset: grain.IterDataset, config: dict[str, int]):
        self._iter = iter(dataset)
        self._config = config

    @property
    def step(self) -> int:
        """Number of batches yielded so far (the index of the next one)."""
        return int(self._iter.get_state()["next_index"])

    @property
    def num_windows(self) -> int:
        """Windows of ``seq_len + 1`` tokens in one epoch."""
        return self._config["num_windows"]

    @property
    def steps_per_epoch(self) -> float:
        """Global batches per pass over the train stream (a batch may straddle two epochs)."""
        return self._config["num_windows"] / self._config["global_batch_size"]

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iter)

    def get_state(self) -> dict[str, Any]:
        return {**self._config, "grain": self._iter.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        for key, value in self._config.items():
            if state.get(key) != value:
                raise DataError(
                    f"data state was saved with {key}={state.get(key)}, this run has {key}={value}: "
                    "resume with the same data, seq_len, global batch size and seed"
                )
        self._iter.set_state(state["grain"])

    def close(self) -> None:
        """Stop the prefetch threads."""
        self._iter.close()


def train_batches(
    tokens: np.ndarray,
    *,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    process_index: Optional[int] = None,
    process_count: Optional[int] = None,
    sharding: Optional[jax.sharding.Sharding] = None,
    trained: Optional[np.ndarray] = None,
    group: int = 1,
) -> BatchIterator:
    """Shuffled, endlessly repeating training batches: this process's share of each step.

    Args:
      tokens: the train stream (1-D; a memory map is read only where batches need it).
      seq_len: tokens per sequence ``T``; windows are ``T + 1`` tokens, non-overlapping.
      global_batch_size: sequences per step over all processes ``B``.
      seed: shuffle seed (non-negative); each epoch is shuffled differently.
      process_index, process_count: default ``jax.process_index()``, ``jax.process_count()``.
      sharding: the batch's sharding; this process then reads exactly the rows its devices
        hold (:func:`batch_rows`), whatever the mesh. Default: rows ``[p*B/P, (p+1)*B/P)``.
      trained: bool like ``tokens`` (:attr:`TokenData.trained`): the targets of the others
        are :data:`~nnxscale.data.chat.IGNORED`.
      group: consecutive windows shuffled and batched together (2: preference pairs); ``B``
        must be a multiple of it.

    Returns:
      A :class:`BatchIterator` of ``{"inputs", "targets"}``, each int32 ``(R, T)`` for this
      process's ``R`` rows (``B/P`` without a sharding).
    """
    rows = _rows(global_batch_size, process_index, process_count, sharding)
    stream = _stream(tokens)
    _check_seq_len(seq_len)
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise DataError(f"seed={seed!r}: give a non-negative integer")
    window = seq_len + 1
    num_windows = len(stream) // window // group * group
    _check_group(global_batch_size, group)
    if num_windows < global_batch_size:
        raise DataError(
            f"the train stream has {len(stream):,} tokens = {num_windows} windows of seq_len+1={window}, "
            f"fewer than one global batch of {global_batch_size}: use more data, a shorter seq_len "
            "or a smaller global batch"
        )
    # grain seeds epoch e with seed + e, so seed 1 would replay seed 0's second epoch; a
    # seed derived through SeedSequence makes different seeds give unrelated orders.
    shuffle_seed = int(np.random.SeedSequence(int(seed)).generate_state(1)[0])
    ds = (
        grain.MapDataset.range(num_windows // group)
        .shuffle(seed=shuffle_seed)
        .repeat()  # infinite; the shuffle reseeds every epoch
        .batch(global_batch_size // group, drop_remainder=True)  # step s: window positions [s*B, (s+1)*B)
        .map(_Gather(stream, seq_len, rows, trained, group))  # B window ids in, only this process's rows read
        .to_iter_dataset(grain.ReadOptions(**_READ_OPTIONS))
    )
    config = {"seq_len": seq_len, "global_batch_size": global_batch_size, "seed": int(seed), "num_windows": num_windows}
    return BatchIterator(ds, config)


def eval_batches(
    tokens: np.ndarray,
    *,
    seq_len: int,
    global_batch_size: int,
    max_batches: Optional[int],
    process_index: Optional[int] = None,
    process_count: Optional[int] = None,
    sharding: Optional[jax.sharding.Sharding] = None,
    trained: Optional[np.ndarray] = None,
    group: int = 1,
) -> list[dict[str, np.ndarray]]:
    """Validation batches in stream order (no shuffle): this process's share of each.

    The first ``min(max_batches, windows // B)`` global batches of consecutive
    ``seq_len + 1`` windows (``max_batches=None``: all of them); same layout (and same
    ``sharding``, ``trained`` and ``group`` arguments) as :func:`train_batches`. An empty
    stream (``val_fraction=0``) gives ``[]``.
    """
    rows = _rows(global_batch_size, process_index, process_count, sharding)
    stream = _stream(tokens)
    _check_seq_len(seq_len)
    if max_batches is not None and max_batches < 0:
        raise DataError(f"max_batches={max_batches}: give a non-negative number, or None for all")
    if len(stream) == 0:
        return []
    window = seq_len + 1
    available = (len(stream) // window) // global_batch_size
    if available == 0:
        raise DataError(
            f"the validation stream has {len(stream):,} tokens, fewer than one global batch of "
            f"{global_batch_size} x seq_len+1={window}: raise val_fraction or lower the eval batch"
        )
    _check_group(global_batch_size, group)
    n = available if max_batches is None else min(max_batches, available)
    gather = _Gather(stream, seq_len, rows, trained, group)
    ds = grain.MapDataset.range(n * global_batch_size // group).batch(global_batch_size // group).map(gather)
    return [ds[i] for i in range(len(ds))]


class _Gather:
    """A global batch's window ids ``(B,)`` (or ids of groups of ``group`` consecutive windows,
    ``(B / group,)``) -> this process's ``rows`` of it, as ``{"inputs", "targets"}`` int32
    ``(R, T)``, reading only those windows. With ``trained``, the targets it marks False are
    :data:`~nnxscale.data.chat.IGNORED`."""

    def __init__(self, tokens: np.ndarray, seq_len: int, rows: np.ndarray, trained: Optional[np.ndarray] = None,
                 group: int = 1):  # fmt: skip
        self.tokens = tokens
        self.seq_len = seq_len
        self.rows = rows
        self.trained = trained
        self.group = group

    def __call__(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        window = self.seq_len + 1
        groups = np.asarray(idx, dtype=np.int64)
        ids = (groups[:, None] * self.group + np.arange(self.group)).reshape(-1)[self.rows]  # (R,)
        positions = ids[:, None] * window + np.arange(window)  # (R, T+1)
        rows = np.asarray(self.tokens[positions], dtype=np.int32)  # touches only these windows' pages
        targets = rows[:, 1:].copy()
        if self.trained is not None:
            targets[~np.asarray(self.trained[positions[:, 1:]], dtype=bool)] = IGNORED
        return {"inputs": rows[:, :-1].copy(), "targets": targets}


def _check_group(global_batch_size: int, group: int) -> None:
    if global_batch_size % group:
        raise DataError(f"a global batch of {global_batch_size} rows does not hold whole groups of {group} rows "
                        f"(a preference pair is {group} rows, chosen then rejected): give an even --batch-size")  # fmt: skip


def _stream(tokens) -> np.ndarray:
    stream = tokens.tokens if isinstance(tokens, TokenData) else np.asanyarray(tokens)  # keeps a memmap a memmap
    if stream.ndim != 1:
        raise DataError(f"tokens have shape {stream.shape}: pass a 1-D token stream (see load_tokens, split)")
    return stream


def _process(index: Optional[int], count: Optional[int]) -> tuple[int, int]:
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    if count < 1 or not 0 <= index < count:
        raise DataError(f"process_index={index}, process_count={count}: need 0 <= index < count")
    return index, count


def _check_seq_len(seq_len: int) -> None:
    if seq_len < 1:
        raise DataError(f"seq_len={seq_len}: give a positive sequence length")


def _rows(
    global_batch_size: int, index: Optional[int], count: Optional[int], sharding: Optional[jax.sharding.Sharding]
) -> np.ndarray:
    """The rows of each global batch this process reads (see :func:`train_batches`)."""
    if sharding is not None:
        return batch_rows(sharding, global_batch_size)
    p, count = _process(index, count)
    if global_batch_size < 1 or global_batch_size % count:
        raise DataError(
            f"global batch {global_batch_size} does not split evenly over {count} processes: "
            f"use a positive multiple of {count}"
        )
    local = global_batch_size // count
    return np.arange(p * local, (p + 1) * local)


# ---------------------------------------------------------------------------------------
# global arrays


def batch_rows(sharding: jax.sharding.Sharding, global_batch_size: int) -> np.ndarray:
    """Rows of a global ``(B, ...)`` batch held by this process's devices, sorted, int64.

    Read from the sharding itself (the union of the row ranges of the process's devices),
    so it is right for any mesh: on a mesh from :func:`nnxscale.make_mesh` with the batch
    split over processes, process ``p`` of ``P`` holds ``[p*B/P, (p+1)*B/P)``; when the batch
    axes all stay inside a process (the processes split only a model axis), every process
    holds all ``B`` rows.

    Raises :class:`DataError` when ``B`` does not split over the sharding's batch axes.
    """
    spec = getattr(sharding, "spec", ())
    rows_only = _rows_only(sharding)
    shape = (global_batch_size,)
    try:
        rows_only.shard_shape(shape)
    except ValueError as e:
        raise DataError(
            f"a global batch of {global_batch_size} rows does not split over {spec} on mesh "
            f"{dict(sharding.mesh.shape)}: make the global batch a multiple of the batch-sharded mesh axes ({e})"
        ) from None
    rows: set[int] = set()
    for index in rows_only.addressable_devices_indices_map(shape).values():
        rows.update(range(*index[0].indices(global_batch_size)))
    return np.array(sorted(rows), dtype=np.int64)


def to_global(local_batch: dict[str, np.ndarray], sharding: jax.sharding.NamedSharding) -> dict[str, jax.Array]:
    """Assemble global ``(B, T)`` arrays from every process's local ``(R, T)`` rows.

    ``local_batch`` holds this process's rows :func:`batch_rows` of the global batch, in
    that order (what :func:`train_batches` yields for the same ``sharding``); each device
    gets its own rows from them, wherever the mesh puts it. ``B`` follows from ``R`` and
    the sharding: ``R`` times the number of batch shards over those this process holds.
    """
    out = {}
    for key, local in local_batch.items():
        global_size = _global_batch_size(local.shape[0], sharding)
        global_shape = (global_size,) + tuple(local.shape[1:])
        rows = batch_rows(sharding, global_size)
        if len(rows) != local.shape[0]:
            raise DataError(
                f"batch {key!r} has {local.shape[0]} rows on process {jax.process_index()}, whose devices hold "
                f"{len(rows)} rows of the global batch of {global_size} under {sharding.spec}"
            )
        position = np.full(global_size, -1, dtype=np.int64)
        position[rows] = np.arange(len(rows))  # global row -> row of local

        def piece(index, local=local, position=position):
            return local[(position[index[0]],) + tuple(index[1:])]

        out[key] = jax.make_array_from_callback(global_shape, sharding, piece)
    return out


def _rows_only(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """``sharding`` of the rows alone: a ``(B,)`` array split as the batch's first dimension
    (a ``context`` axis that splits the length does not change who holds which rows)."""
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return sharding
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(spec[0] if len(spec) else None))


def _global_batch_size(local_rows: int, sharding: jax.sharding.Sharding) -> int:
    """``B`` such that this process holds ``local_rows`` of it under ``sharding``."""
    shards = sharding.mesh.size // _rows_only(sharding).shard_shape((sharding.mesh.size,))[0]
    held = len(batch_rows(sharding, shards))  # with one row per shard: the shards held here
    return local_rows * shards // held
