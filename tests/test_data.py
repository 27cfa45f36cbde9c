"""The data path: sources -> token stream -> split -> per-process batches -> global arrays."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnxscale
from nnxscale.data import tokens as data
from nnxscale.data import text as text
from nnxscale.data.tokens import DataError

T = 8  # seq_len of the synthetic streams
W = T + 1  # window


def arange_stream(num_windows: int) -> np.ndarray:
    """Token i is i, so a row's first input names its window: inputs[r, 0] // W."""
    return np.arange(num_windows * W, dtype=np.int32)


def window_ids(batch) -> list[int]:
    return [int(x) // W for x in batch["inputs"][:, 0]]


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() == {"inputs", "targets"}
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])


@pytest.fixture(scope="module")
def stdlib():
    return data.load_tokens()


# ---------------------------------------------------------------------------------------
# sources


def test_stdlib_corpus_is_real_and_deterministic(stdlib):
    files = text.stdlib_files()
    assert files == sorted(files, key=lambda p: p.relative_to(text.stdlib_root()).as_posix())
    assert not any("site-packages" in p.parts or "__pycache__" in p.parts for p in files)
    texts = [p.read_bytes() for p in files]
    texts = [t for t in texts if t]  # empty files (bare __init__.py) add nothing
    assert stdlib.tokens.dtype == np.uint8 and stdlib.vocab_size == 256
    assert len(stdlib.tokens) > 1_000_000
    # the documents, in order, joined by exactly one separator each
    assert len(stdlib.tokens) == sum(map(len, texts)) + len(texts) - 1
    assert int((stdlib.tokens == text.SEPARATOR).sum()) == len(texts) - 1
    assert stdlib.tokens[: len(texts[0])].tobytes() == texts[0]
    assert stdlib.tokens[-len(texts[-1]) :].tobytes() == texts[-1]
    assert f"{len(texts)} .py files" in stdlib.description
    again = data.load_tokens("stdlib", max_tokens=100_000)
    np.testing.assert_array_equal(again.tokens, stdlib.tokens[:100_000])
    assert again.fingerprint == data.fingerprint(stdlib.tokens[:100_000]) != stdlib.fingerprint


def test_text_directory_sorted_joined_and_binary_skipped(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"zz")
    (tmp_path / "b" / "a.md").write_bytes(b"ba")
    (tmp_path / "a.txt").write_bytes(b"hello")
    (tmp_path / "c.png").write_bytes(b"\x89PNG\x00\x01")  # binary: skipped
    (tmp_path / "empty.txt").write_bytes(b"")  # empty: skipped
    got = data.load_tokens(tmp_path)
    assert got.tokens.tobytes() == b"hello\0ba\0zz"
    assert got.tokens.dtype == np.uint8 and got.vocab_size == 256
    assert str(tmp_path) in got.description and "3 text files" in got.description
    assert got.fingerprint == data.load_tokens(str(tmp_path)).fingerprint
    assert data.load_tokens(tmp_path, max_tokens=7).tokens.tobytes() == b"hello\0b"


def test_text_file(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    got = data.load_tokens(path)
    np.testing.assert_array_equal(got.tokens, np.frombuffer(path.read_bytes(), np.uint8))
    assert got.vocab_size == 256


def test_bin_tokens_are_memory_mapped_uint16(tmp_path):
    tokens = np.array([50256, 7, 0, 1234, 7], dtype=np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    got = data.load_tokens(path)
    assert isinstance(got.tokens, np.memmap) and got.tokens.dtype == np.uint16
    np.testing.assert_array_equal(got.tokens, tokens)
    assert got.vocab_size == 50257
    assert data.load_tokens(path, vocab_size=60000).vocab_size == 60000
    with pytest.raises(DataError, match="outside vocab_size=100"):
        data.load_tokens(path, vocab_size=100)


def test_npy_tokens(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.int32))
    got = data.load_tokens(path)
    assert got.tokens.dtype == np.int32
    np.testing.assert_array_equal(got.tokens, [3, 1, 4, 1, 5, 9, 2, 6])
    assert got.vocab_size == 10
    np.testing.assert_array_equal(data.load_tokens(path, max_tokens=3).tokens, [3, 1, 4])
    # another integer dtype is converted to int32 (in memory)
    np.save(tmp_path / "wide.npy", np.array([70000, 2], dtype=np.int64))
    wide = data.load_tokens(tmp_path / "wide.npy")
    assert wide.tokens.dtype == np.int32 and wide.vocab_size == 70001
    np.testing.assert_array_equal(wide.tokens, [70000, 2])


def test_fingerprint_sees_one_changed_token():
    a = np.arange(1000, dtype=np.uint16)
    b = a.copy()
    b[500] += 1
    assert data.fingerprint(a) == data.fingerprint(a.copy()) != data.fingerprint(b)
    assert len(data.fingerprint(a)) == 16


def _make_bad(tmp_path, kind):
    if kind == "missing":
        return tmp_path / "no_such_file.txt"
    if kind == "empty_dir":
        (tmp_path / "d").mkdir()
        return tmp_path / "d"
    if kind == "binary_only_dir":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "blob").write_bytes(b"\x00\x01\x02")
        (tmp_path / "d" / "nothing.txt").write_bytes(b"")
        return tmp_path / "d"
    if kind == "empty_file":
        (tmp_path / "e.txt").write_bytes(b"")
        return tmp_path / "e.txt"
    if kind == "binary_file":
        (tmp_path / "x.dat").write_bytes(b"ab\x00cd")
        return tmp_path / "x.dat"
    if kind == "empty_bin":
        (tmp_path / "e.bin").write_bytes(b"")
        return tmp_path / "e.bin"
    if kind == "odd_bin":
        (tmp_path / "o.bin").write_bytes(b"\x01\x02\x03")
        return tmp_path / "o.bin"
    if kind == "float_npy":
        np.save(tmp_path / "f.npy", np.ones(10, dtype=np.float32))
        return tmp_path / "f.npy"
    if kind == "2d_npy":
        np.save(tmp_path / "m.npy", np.ones((2, 5), dtype=np.int32))
        return tmp_path / "m.npy"
    if kind == "negative_npy":
        np.save(tmp_path / "n.npy", np.array([1, -1], dtype=np.int32))
        return tmp_path / "n.npy"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind, words",
    [
        ("missing", "does not exist"),
        ("empty_dir", "no usable text file"),
        ("binary_only_dir", "no usable text file"),
        ("empty_file", "is empty"),
        ("binary_file", "not text"),
        ("empty_bin", "is empty"),
        ("odd_bin", "not uint16"),
        ("float_npy", "float32, not an integer type"),
        ("2d_npy", "shape (2, 5)"),
        ("negative_npy", "negative token"),
    ],
)
def test_bad_source_names_the_path(tmp_path, kind, words):
    path = _make_bad(tmp_path, kind)
    with pytest.raises(DataError) as info:
        data.load_tokens(path)
    assert str(path) in str(info.value) and words in str(info.value)


def test_stream_too_short_for_one_sequence_plus_validation(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"x" * 100)
    tiny = data.load_tokens(path)
    data.split(tiny, 0.1, seq_len=8)  # 90 + 10 tokens: one window of 9 each
    with pytest.raises(DataError) as info:
        data.split(tiny, 0.1, seq_len=16)  # val has 10 tokens, needs 17
    assert str(path) in str(info.value) and "seq_len+1=17" in str(info.value)
    with pytest.raises(DataError, match="seq_len\\+1=101"):
        data.split(tiny, 0.0, seq_len=100)


# ---------------------------------------------------------------------------------------
# split


def test_split_is_the_contiguous_tail():
    stream = np.arange(1000, dtype=np.int32)
    train, val = data.split(stream, 0.1)
    np.testing.assert_array_equal(train, np.arange(900))
    np.testing.assert_array_equal(val, np.arange(900, 1000))
    train, val = data.split(stream, 0.0)
    assert len(train) == 1000 and len(val) == 0
    for bad in (-0.1, 1.0):
        with pytest.raises(DataError, match="val_fraction"):
            data.split(stream, bad)


# ---------------------------------------------------------------------------------------
# training batches


def test_batch_layout_shift_and_train_split_only(stdlib):
    train, val = data.split(stdlib, 0.1, seq_len=256)
    it = data.train_batches(train, seq_len=256, global_batch_size=4, seed=0, process_index=0, process_count=1)
    batch = next(it)
    assert batch["inputs"].shape == batch["targets"].shape == (4, 256)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    # every row is a window of the train stream at a multiple of seq_len+1
    windows = train[: len(train) // 257 * 257].reshape(-1, 257)
    for inputs, targets in zip(batch["inputs"], batch["targets"]):
        row = np.append(inputs, targets[-1])
        assert (windows == row).all(axis=1).any()

    # with token i == i: over two epochs no row reaches past the train split
    stream = arange_stream(40)
    train, val = data.split(stream, 0.25)
    it = data.train_batches(train, seq_len=T, global_batch_size=5, seed=3, process_index=0, process_count=1)
    for batch in take(it, 12):  # 60 windows = 2 epochs of 30
        np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)
        assert (batch["inputs"][:, 0] % W == 0).all()
        assert (batch["targets"] < len(train)).all() and not np.isin(batch["inputs"], val).any()


def test_seed_decides_the_order():
    stream = arange_stream(64)
    make = lambda seed: data.train_batches(stream, seq_len=T, global_batch_size=8, seed=seed, process_index=0, process_count=1)
    assert_batches_equal(take(make(7), 5), take(make(7), 5))
    a, b = take(make(7), 5), take(make(8), 5)
    assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))


def test_every_epoch_is_a_new_permutation_of_all_windows():
    stream = arange_stream(24)
    it = data.train_batches(stream, seq_len=T, global_batch_size=6, seed=0, process_index=0, process_count=1)
    assert it.num_windows == 24 and it.steps_per_epoch == 4
    order = [w for batch in take(it, 12) for w in window_ids(batch)]  # 3 epochs
    epochs = [order[i : i + 24] for i in range(0, 72, 24)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(24))
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert epochs[0] != list(range(24))


def test_resume_continues_exactly(stdlib):
    train, _ = data.split(stdlib, 0.05)
    make = lambda: data.train_batches(train, seq_len=64, global_batch_size=8, seed=1, process_index=0, process_count=1)
    full = take(make(), 7)
    first = make()
    take(first, 3)
    state = json.loads(json.dumps(first.get_state()))
    first.close()
    resumed = make()
    resumed.set_state(state)
    assert resumed.step == 3
    assert_batches_equal(take(resumed, 4), full[3:])


def test_resume_refuses_a_different_setup():
    stream = arange_stream(64)
    it = data.train_batches(stream, seq_len=T, global_batch_size=8, seed=1, process_index=0, process_count=1)
    next(it)
    other = data.train_batches(stream, seq_len=T, global_batch_size=8, seed=2, process_index=0, process_count=1)
    with pytest.raises(DataError, match="seed=1, this run has seed=2"):
        other.set_state(it.get_state())


@pytest.mark.parametrize("num_windows, seed", [(32, 0), (30, 5)])
def test_two_processes_split_each_global_batch(num_windows, seed):
    stream = arange_stream(num_windows)  # 30 windows, batch 8: some steps straddle two epochs
    whole = data.train_batches(stream, seq_len=T, global_batch_size=8, seed=seed, process_index=0, process_count=1)
    procs = [data.train_batches(stream, seq_len=T, global_batch_size=8, seed=seed, process_index=p, process_count=2) for p in (0, 1)]
    for _ in range(10):
        global_batch = next(whole)
        local = [next(it) for it in procs]
        assert local[0]["inputs"].shape == (4, T)
        ids = [window_ids(b) for b in local]
        assert sorted(ids[0] + ids[1]) == sorted(window_ids(global_batch))
        if num_windows % 8 == 0:  # within one epoch a window occurs once
            assert len(set(ids[0] + ids[1])) == 8
        # in process order the local rows are the 1-process batch, row for row
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(np.concatenate([b[key] for b in local]), global_batch[key])


def test_state_from_one_process_resumes_on_two():
    stream = arange_stream(30)
    whole = data.train_batches(stream, seq_len=T, global_batch_size=8, seed=4, process_index=0, process_count=1)
    take(whole, 5)
    state = whole.get_state()
    expected = take(whole, 3)
    for p in (0, 1):
        it = data.train_batches(stream, seq_len=T, global_batch_size=8, seed=4, process_index=p, process_count=2)
        it.set_state(state)
        for got, want in zip(take(it, 3), expected):
            np.testing.assert_array_equal(got["inputs"], want["inputs"][4 * p : 4 * (p + 1)])


class _CountingTokens(np.ndarray):
    """A token array that counts the elements read through indexing."""

    reads = 0

    def __getitem__(self, key):
        out = super().__getitem__(key)
        _CountingTokens.reads += np.size(out)
        return out


def test_batches_read_only_their_own_windows():
    stream = arange_stream(20_000).view(_CountingTokens)
    _CountingTokens.reads = 0
    it = data.train_batches(stream, seq_len=T, global_batch_size=8, seed=0, process_index=1, process_count=2)
    take(it, 5)
    it.close()
    # 5 local batches of 4 windows, plus what the prefetch buffer read ahead
    assert 5 * 4 * W <= _CountingTokens.reads <= 30 * 4 * W


def test_bad_batch_layouts():
    stream = arange_stream(10)
    with pytest.raises(DataError, match="global batch 6 does not split evenly over 4 processes"):
        data.train_batches(stream, seq_len=T, global_batch_size=6, seed=0, process_index=0, process_count=4)
    with pytest.raises(DataError, match="10 windows of seq_len\\+1=9, fewer than one global batch of 16"):
        data.train_batches(stream, seq_len=T, global_batch_size=16, seed=0, process_index=0, process_count=1)
    with pytest.raises(DataError, match="process_index=2, process_count=2"):
        data.train_batches(stream, seq_len=T, global_batch_size=2, seed=0, process_index=2, process_count=2)


def test_defaults_to_this_jax_process():
    stream = arange_stream(16)
    it = data.train_batches(stream, seq_len=T, global_batch_size=4, seed=0)
    assert next(it)["inputs"].shape == (4 // jax.process_count(), T)


# ---------------------------------------------------------------------------------------
# validation batches


def test_eval_batches_in_order_and_shared_by_processes():
    stream = arange_stream(50)
    whole = data.eval_batches(stream, seq_len=T, global_batch_size=8, max_batches=None, process_index=0, process_count=1)
    assert [window_ids(b) for b in whole] == [list(range(i, i + 8)) for i in range(0, 48, 8)]
    assert len(data.eval_batches(stream, seq_len=T, global_batch_size=8, max_batches=2, process_index=0, process_count=1)) == 2
    procs = [data.eval_batches(stream, seq_len=T, global_batch_size=8, max_batches=3, process_index=p, process_count=2) for p in (0, 1)]
    for step in range(3):
        assert procs[0][step]["inputs"].shape == (4, T)
        np.testing.assert_array_equal(np.concatenate([procs[0][step]["targets"], procs[1][step]["targets"]]), whole[step]["targets"])
    assert data.eval_batches(stream[:0], seq_len=T, global_batch_size=8, max_batches=3) == []
    with pytest.raises(DataError, match="validation stream has 45 tokens"):
        data.eval_batches(stream[:45], seq_len=T, global_batch_size=8, max_batches=3)


# ---------------------------------------------------------------------------------------
# global arrays


def test_to_global_shards_the_batch_over_data():
    mesh = nnxscale.make_mesh("data=4,model=2")
    sharding = NamedSharding(mesh, P("data", None))
    it = data.train_batches(arange_stream(64), seq_len=T, global_batch_size=8, seed=0)
    local = next(it)
    batch = data.to_global(local, sharding)
    for key in ("inputs", "targets"):
        array = batch[key]
        assert array.shape == (8, T) and array.sharding == sharding
        np.testing.assert_array_equal(np.asarray(array), local[key])
        assert len(array.addressable_shards) == 8
        for shard in array.addressable_shards:
            assert shard.data.shape == (2, T)
            np.testing.assert_array_equal(np.asarray(shard.data), local[key][shard.index])
    with pytest.raises(DataError, match="does not split over"):
        data.to_global({"inputs": local["inputs"][:6]}, sharding)
