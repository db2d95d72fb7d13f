"""`gpipe-coordinator tokenize`: a corpus into the token ids its tokenizer gives, the same bytes whatever the
workers, and after a run killed half-way; its bad inputs are one line, exit 2."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from tests.support.cli import one_error_line, wait_for
from tests.support.lm import LINES, bpe_tokenizer

tokenizers = pytest.importorskip("tokenizers")


def _corpus(tmp, tok):
    """a.txt (one document) and b.jsonl (a document a line), and the ids they make, each document followed
    by <|endoftext|>."""
    text = "".join(f"{line} {i}\n" for i in range(40) for line in LINES)
    (tmp / "a.txt").write_text(text)
    rows = [f"{line}, row {i}" for i, line in enumerate(LINES * 3)]
    (tmp / "b.jsonl").write_text("".join(json.dumps({"text": r, "id": i}) + "\n" for i, r in enumerate(rows)))
    eos = tok.token_to_id("<|endoftext|>")
    ids = []
    for doc in [text, *rows]:
        ids += tok.encode(doc, add_special_tokens=False).ids + [eos]
    return ids


@pytest.mark.multiprocess
def test_tokenize_writes_the_tokenizer_s_ids_whatever_the_workers(cli):
    tok = bpe_tokenizer(cli.tmp / "tok")
    want = _corpus(cli.tmp, tok)
    for workers, out in [("1", "data/train.bin"), ("2", "two/train.bin")]:
        r = cli.run("tokenize", "a.txt", "b.jsonl", "--tokenizer", "tok", "--out", out, "--val-fraction", "0.1",
                    "--eos", "<|endoftext|>", "--workers", workers, timeout=60)
        assert r.returncode == 0, r.stderr
        val = len(want) - round(len(want) * 0.9)
        folder = out.split("/")[0]
        assert r.stdout.strip() == (f"{folder}/train.bin: {len(want) - val:,} tokens, {folder}/val.bin: {val:,} "
                                    f"tokens, uint16 (vocabulary 300)")
        assert "tokens/s" in r.stderr  # the progress bar
        got = [np.fromfile(cli.tmp / folder / f, dtype="<u2") for f in ("train.bin", "val.bin")]
        assert np.concatenate(got).tolist() == want and len(got[1]) == val
        assert sorted(os.listdir(cli.tmp / folder)) == ["train.bin", "val.bin"]
    assert (cli.tmp / "data" / "train.bin").read_bytes() == (cli.tmp / "two" / "train.bin").read_bytes()


@pytest.mark.multiprocess
def test_tokenize_killed_half_way_leaves_no_file_and_a_rerun_writes_the_same_bytes(cli):
    tok = bpe_tokenizer(cli.tmp / "tok")
    want = _corpus(cli.tmp, tok)
    (cli.tmp / "b.jsonl").rename(cli.tmp / "rows")
    os.mkfifo(cli.tmp / "b.jsonl")  # the run blocks there, a.txt's tokens written: half-way
    args = ["tokenize", "a.txt", "b.jsonl", "--tokenizer", "tok", "--out", "data/train.bin",
            "--eos", "<|endoftext|>"]
    partial = cli.tmp / "data" / "train.bin.partial"
    semaphores = set(Path("/dev/shm").glob("sem.mp-*"))
    with cli.running(*args, "--workers", "2") as p:
        wait_for(lambda: partial.exists() and partial.stat().st_size > 0 or p.poll() is not None, 60,
                 "a.txt's tokens in train.bin.partial")
        assert p.poll() is None, p.communicate()
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    # The kill took multiprocessing's resource tracker with the pool: the semaphores it would have unlinked are
    # ours to, those new since the start that no live process maps (another test's pool may be making its own).
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped |= {line.split()[-1] for line in maps.read_text().splitlines() if "/dev/shm/sem." in line}
    for sem in set(Path("/dev/shm").glob("sem.mp-*")) - semaphores:
        if str(sem) not in mapped:
            sem.unlink(missing_ok=True)
    assert not (cli.tmp / "data" / "train.bin").exists()
    (cli.tmp / "b.jsonl").unlink()
    (cli.tmp / "rows").rename(cli.tmp / "b.jsonl")
    r = cli.run(*args, timeout=60)
    assert r.returncode == 0, r.stderr
    assert np.fromfile(cli.tmp / "data" / "train.bin", dtype="<u2").tolist() == want
    assert os.listdir(cli.tmp / "data") == ["train.bin"]


@pytest.mark.multiprocess
def test_tokenize_s_bad_input_is_one_line_exit_2(cli):
    bpe_tokenizer(cli.tmp / "tok")
    (cli.tmp / "a.txt").write_text("some text\n")
    (cli.tmp / "afile").write_text("")
    (cli.tmp / "b.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    for args, says in [
        (["missing.txt", "--tokenizer", "tok"], "error: missing.txt: no such corpus file"),
        (["a.txt", "--tokenizer", "none"], "error: --tokenizer none: no such folder"),
        (["a.txt", "--tokenizer", "."], "error: --tokenizer .: no tokenizer.json in it"),
        (["a.txt", "--tokenizer", "tok", "--out", "afile/train.bin"], "error: --out: "),
        (["a.txt", "b.jsonl", "--tokenizer", "tok", "--out", "new/train.bin", "--no-progress"],
         "error: b.jsonl:2: no text field 'text' (--text-field names another)"),
    ]:
        r = cli.run("tokenize", *args, *(["--out", "train.bin"] if "--out" not in args else []), timeout=60)
        assert r.returncode == 2, r.stderr
        one_error_line(r.stderr, says)
    assert sorted(os.listdir(cli.tmp)) == ["a.txt", "afile", "b.jsonl", "tok"]  # nothing left behind


@pytest.mark.multiprocess
def test_tokenize_trains_a_byte_level_bpe_on_the_corpus_offline_and_tokenizes_with_it(cli):
    # No tokenizer to download: --train-vocab trains GPT-2's kind on the corpus itself, writes tok/tokenizer.json,
    # and the token files are that tokenizer's ids (what generate.py and the tokens source then read).
    _corpus(cli.tmp, bpe_tokenizer(cli.tmp / "ref"))  # a.txt and b.jsonl
    r = cli.run("tokenize", "a.txt", "b.jsonl", "--train-vocab", "320", "--tokenizer", "tok", "--out",
                "data/train.bin", "--eos", "<|endoftext|>", "--no-progress", timeout=120)
    assert r.returncode == 0, r.stderr
    tok = tokenizers.Tokenizer.from_file(str(cli.tmp / "tok" / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert 256 < vocab <= 320 and tok.token_to_id("<|endoftext|>") is not None
    want = _corpus(cli.tmp, tok)  # the corpus again, and its ids with the trained tokenizer
    assert np.fromfile(cli.tmp / "data" / "train.bin", dtype="<u2").tolist() == want
    assert r.stdout.splitlines()[0].startswith(f"tok/tokenizer.json: a byte-level BPE tokenizer of {vocab} ids")
    assert r.stdout.splitlines()[1] == f"data/train.bin: {len(want):,} tokens, uint16 (vocabulary {vocab})"
    assert tok.decode(want[:20]) == tok.decode(tok.encode((cli.tmp / "a.txt").read_text()[:200]).ids[:20])
    assert sorted(os.listdir(cli.tmp / "tok")) == ["tokenizer.json"]
    # A tokenizer there already is not overwritten; a vocabulary below the bytes' is refused; a failure leaves
    # neither the tokenizer nor the token files.
    (cli.tmp / "bad.jsonl").write_text('{"body": "no text"}\n')
    for args, says in [
        (["a.txt", "--train-vocab", "320", "--tokenizer", "tok"], "error: --tokenizer tok: tok/tokenizer.json exists"),
        (["a.txt", "--train-vocab", "256", "--tokenizer", "new", "--eos", "<|endoftext|>"],
         "error: --train-vocab 256: expected 257 (the 256 bytes and --eos) to 1,048,576 ids"),
        (["a.txt", "bad.jsonl", "--train-vocab", "300", "--tokenizer", "new"], "error: bad.jsonl:1: no text field"),
    ]:
        r = cli.run("tokenize", *args, "--out", "new/train.bin", "--no-progress", timeout=60)
        assert r.returncode == 2, r.stderr
        one_error_line(r.stderr, says)
        assert not (cli.tmp / "new").exists()


def test_a_parquet_file_s_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from gpipe.coordinator.cli.corpus import _pieces

    pq.write_table(pa.table({"id": [1, 2, 3], "body": ["one", None, "three"]}), tmp_path / "c.parquet")
    (tmp_path / "d.txt").write_text("four\nfive\n")
    pieces = list(_pieces([tmp_path / "c.parquet", tmp_path / "d.txt"], "body"))
    assert pieces == [[("one", True), ("", True), ("three", True)], [("four\nfive\n", True)]]
