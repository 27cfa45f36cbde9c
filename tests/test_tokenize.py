"""Text through real tokenizers: ``nnxscale tokenize``, training and sampling with the run's
tokenizer, and bad input, one line each. The tokenizer is trained here, with the
``tokenizers`` trainer (``bpe_tokenizer`` in conftest); nothing is downloaded."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from flax import nnx
from model_testing import greedy_by_hand
from test_cli import assert_one_error_line, run_main, train_args
from tokenizers import Tokenizer, models, pre_tokenizers

import nnxscale
from nnxscale.data import text as text
from nnxscale.errors import DataError
from nnxscale.models import gpt2


def documents(tmp_path, text_data):
    """A corpus directory: two text documents and a binary file (skipped)."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    source = text_data.read_text()
    (corpus / "a.txt").write_text(source[:40_000])
    (corpus / "sub" / "b.md").write_text(source[40_000:60_000])
    (corpus / "blob.dat").write_bytes(b"\x00\x01binary")
    return corpus, [source[:40_000], source[40_000:60_000]]


def test_tokenize_writes_the_token_file_train_reads(tmp_path, text_data, bpe_tokenizer, capsys):
    corpus, docs = documents(tmp_path, text_data)
    tok = Tokenizer.from_file(str(bpe_tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    want = np.concatenate([tok.encode(docs[0]).ids, [eos], tok.encode(docs[1]).ids])

    out = tmp_path / "train.bin"
    code, printed, err = run_main(capsys, ["tokenize", "--tokenizer", str(bpe_tokenizer), "--data", str(corpus),
                                           "--out", str(out), "--no-progress"])  # fmt: skip
    assert code == 0, err
    assert f"{out}: {len(want):,} tokens (uint16, vocab 512) from 2 documents (1 empty or binary files skipped)" in printed
    assert f"--data {out}" in printed
    got = nnxscale.load_tokens(out)
    assert got.tokens.dtype == np.uint16
    np.testing.assert_array_equal(got.tokens, want)

    # .npy holds the same tokens; train's own reading of the text with the tokenizer gives them too
    info = text.tokenize(bpe_tokenizer, corpus, tmp_path / "train.npy", progress=True)
    assert info["dtype"] == "uint16" and info["tokens"] == len(want)
    np.testing.assert_array_equal(np.load(tmp_path / "train.npy"), want)
    loaded = nnxscale.load_tokens(corpus, tokenizer=bpe_tokenizer)
    np.testing.assert_array_equal(loaded.tokens, want)
    assert loaded.vocab_size == 512 and f"tokenizer {bpe_tokenizer}" in loaded.description


def test_tokenize_refuses_a_vocabulary_the_token_file_cannot_hold(tmp_path, capsys):
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    big.save(str(tmp_path / "big.json"))
    (tmp_path / "t.txt").write_text("w1 w69999 w5\n")
    args = ["tokenize", "--tokenizer", str(tmp_path / "big.json"), "--data", str(tmp_path / "t.txt"), "--no-progress"]

    code, _, err = run_main(capsys, [*args, "--out", str(tmp_path / "t.bin")])
    assert_one_error_line(code, err, "70,000 tokens", "uint16", "65,536", str(tmp_path / "t.npy"))
    assert not (tmp_path / "t.bin").exists()
    code, _, err = run_main(capsys, [*args, "--out", str(tmp_path / "t.npy")])
    assert code == 0, err
    tokens = np.load(tmp_path / "t.npy")
    assert tokens.dtype == np.int32 and tokens.tolist() == [1, 69999, 5]

    code, _, err = run_main(capsys, [*args, "--out", str(tmp_path / "t.txt.out")])
    assert_one_error_line(code, err, ".bin", ".npy")


def test_bad_tokenizers_and_token_ids_are_one_line_each(tmp_path, text_data, bpe_tokenizer, capsys):
    (tmp_path / "broken.json").write_text('{"not": "a tokenizer"}')
    wide = tmp_path / "wide.bin"
    np.array([1, 2, 300, 4] * 200, dtype=np.uint16).tofile(wide)
    cases = [
        (["--tokenizer", str(bpe_tokenizer)], ["tokenizer", "512 tokens", "gpt2-tiny's vocabulary of 256"]),
        (["--model", "gpt2"], ["gpt2 has a vocabulary of 50,257", "not bytes", "--tokenizer", "nnxscale tokenize"]),
        (["--data", str(wide)], [str(wide), "token id 300", "gpt2-tiny's vocabulary of 256"]),
        (["--tokenizer", str(tmp_path / "none.json")], ["no tokenizer at", "none.json", "never downloaded"]),
        (["--tokenizer", str(tmp_path / "broken.json")], ["broken.json", "is not a tokenizer.json"]),
    ]
    for extra, words in cases:
        run_dir = tmp_path / "run"
        code, _, err = run_main(capsys, train_args(run_dir, text_data, *extra))
        assert_one_error_line(code, err, *words)
        assert not run_dir.exists()  # refused before anything is written


def test_fine_tune_a_hugging_face_directory_on_text_and_sample_words(tmp_path, text_data, bpe_tokenizer, monkeypatch, capsys):
    """--init-from a Hugging Face directory that holds a tokenizer.json: the text is read
    through it, the run keeps a copy, a resume reads the same tokens, sample decodes with it."""
    config = dataclasses.replace(gpt2.preset("gpt2-tiny"), vocab_size=512)  # the tokenizer's vocabulary
    monkeypatch.setitem(gpt2.PRESETS, "gpt2-tiny-bpe", config)
    hf = tmp_path / "hf"
    gpt2.save_pretrained(gpt2.GPT2(config, rngs=nnx.Rngs(3)), hf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bpe_tokenizer.with_name(name), hf / name)

    run_dir = tmp_path / "run"
    args = train_args(run_dir, text_data, "--model", "gpt2-tiny-bpe", "--init-from", str(hf), "--save-every", "0")
    code, out, err = run_main(capsys, args)
    assert code == 0, err
    assert (run_dir / "tokenizer.json").read_bytes() == bpe_tokenizer.read_bytes()
    assert "tokenizer" in json.loads((run_dir / "config.json").read_text())["data"]
    code, out, err = run_main(capsys, [*args, "--steps", "6"])  # resumes on the kept copy: the same tokens
    assert code == 0 and f"resumed {run_dir} from step 4" in out, err

    prompt, n = "def parse", 12
    got = nnxscale.sample(run_dir, prompt, max_new_tokens=n, temperature=0)
    # The same greedy choices by hand, decoded with the tokenizer: words, not bytes or ids.
    tok, model = Tokenizer.from_file(str(bpe_tokenizer)), nnxscale.load_model(run_dir)
    assert got == prompt + tok.decode(greedy_by_hand(model, tok.encode(prompt).ids, n, config.n_positions))
    code, out, err = run_main(capsys, ["sample", "--run-dir", str(run_dir), "--prompt", prompt,
                                       "--max-new-tokens", str(n), "--temperature", "0"])  # fmt: skip
    assert code == 0 and out == got + "\n", err


# --------------------------------------------------------------------------------------
# JSON Lines and Parquet corpora
# --------------------------------------------------------------------------------------


def _documents():
    import argparse
    import inspect

    source = inspect.getsource(argparse)
    return [source[i : i + 2000] for i in range(0, 40_000, 2000)] + ["naïve café ☕ — unicode survives"]


def test_json_lines_and_parquet_give_the_tokens_of_their_documents_encoded_one_by_one(tmp_path, bpe_tokenizer, capsys):
    """Each row is a document: the token stream equals encoding the documents one at a time,
    joined by the end-of-text token, for .jsonl, .jsonl.gz (another field), .parquet (small
    row groups: read one at a time), alone and in a directory; `nnxscale tokenize` writes
    the same tokens."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from nnxscale.data import tokens as datalib

    docs = _documents()
    tok = text.load_tokenizer(bpe_tokenizer)
    want = []
    for i, d in enumerate(docs):
        want += ([tok.separator] if i else []) + tok.encode(d)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in docs)
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), tmp_path / "c.parquet", row_group_size=4)

    cases = [(corpus / "a.jsonl", text.Records()), (tmp_path / "b.jsonl.gz", text.Records("body")),
             (tmp_path / "c.parquet", text.Records()), (corpus, text.Records())]  # fmt: skip
    for source, records in cases:
        got = datalib.load_tokens(source, tokenizer=bpe_tokenizer, records=records)
        assert got.tokens.tolist() == want, source
        # the progress bar's bytes count the files as stored, compressed or not: they end at their total
        corpus_of, stats, seen = text.read_corpus(source, records), text.EncodeStats(), []
        for _ in text.encode_corpus(corpus_of, tok, stats):
            seen.append(stats.read_bytes)
        assert seen == sorted(seen) and seen[-1] == corpus_of.total_bytes(), (source, seen, corpus_of.total_bytes())
    code, out, err = run_main(capsys, ["tokenize", "--tokenizer", str(bpe_tokenizer), "--data", str(tmp_path / "c.parquet"),
                                       "--out", str(tmp_path / "c.npy"), "--no-progress"])  # fmt: skip
    assert code == 0, err
    assert np.load(tmp_path / "c.npy").tolist() == want and f"from {len(docs)} documents" in out, out


def test_bad_rows_are_one_line_naming_the_file_and_row_or_are_skipped_and_counted(tmp_path, bpe_tokenizer, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nnxscale.data import tokens as datalib

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "first"}) + "\n{not json\n" + json.dumps({"text": 3}) + "\n"
                   + json.dumps({"title": "x"}) + "\n" + json.dumps({"text": "last"}) + "\n")  # fmt: skip
    out = tmp_path / "bad.npy"
    tokenize = ["tokenize", "--tokenizer", str(bpe_tokenizer), "--data", str(bad), "--out", str(out), "--no-progress"]
    code, _, err = run_main(capsys, tokenize)
    assert_one_error_line(code, err, f"{bad}: row 2: not JSON", "--skip-bad-rows")
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))  # nothing half-written
    code, stdout, err = run_main(capsys, [*tokenize, "--skip-bad-rows"])
    assert code == 0 and "from 2 documents (3 bad rows skipped)" in stdout, (stdout, err)
    tok = text.load_tokenizer(bpe_tokenizer)
    assert np.load(out).tolist() == tok.encode("first") + [tok.separator] + tok.encode("last")

    three = tmp_path / "three.jsonl"  # byte-level, through train's loader
    three.write_text("".join(json.dumps({"text": v}) + "\n" for v in ("a", "b", 3)))
    with pytest.raises(DataError, match=r"three.jsonl: row 3: 'text' is int, not text"):
        datalib.load_tokens(three)
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p.parquet: no column 'text' \(columns: body\): choose one with --text-field"):
        datalib.load_tokens(tmp_path / "p.parquet")
