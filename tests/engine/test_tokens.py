"""Token files (gpipe.data.tokens): the windows, the stream across files, the glob, the shuffle's permutation, and one
line per bad input."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import yaml

import gpipe.data.tokens
from gpipe.coordinator.plan.data import DataStream
from gpipe.coordinator.plan.job import make_plan
from gpipe.coordinator.spec.job import parse_spec
from gpipe.data.tokens import tokens
from gpipe.errors import SpecError
from gpipe.factory import resolve
from tests.support.spec import TWO_STAGES, job


def _write(path, ids, dtype="<u2"):
    np.asarray(ids, dtype=dtype).tofile(path)
    return str(path)


def test_item_i_is_the_window_at_i_times_seq_len_and_its_shift(tmp_path):
    path = _write(tmp_path / "t.bin", range(23))
    data = resolve("tokens")(path=path, seq_len=5)
    assert len(data) == 4  # (23 - 1) // 5: the last partial window left out
    x, y = data[3]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == [15, 16, 17, 18, 19] and y.tolist() == [16, 17, 18, 19, 20]
    assert data[-1][0].tolist() == x.tolist()
    with pytest.raises(IndexError):
        data[4]


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_files_are_one_stream_in_name_order_and_windows_span_them(tmp_path, dtype):
    big = 70_000 if dtype == "uint32" else 60_000  # a uint32 file holds ids above 65535
    ids = [big + i for i in range(40)]
    np_dtype = "<u2" if dtype == "uint16" else "<u4"
    for name, part in [("b.bin", ids[13:30]), ("a.bin", ids[:13]), ("c.bin", ids[30:]), ("d.bin", [])]:
        _write(tmp_path / name, part, np_dtype)
    whole = _write(tmp_path / "whole.tok", ids, np_dtype)
    one, glob_ = tokens(whole, 4, dtype), tokens(str(tmp_path / "*.bin"), 4, dtype)
    listed = tokens([str(tmp_path / n) for n in ["a.bin", "b.bin", "c.bin"]], 4, dtype)
    assert len(one) == len(glob_) == len(listed) == 9
    for i in range(9):
        for d in (glob_, listed):
            assert all(torch.equal(a, b) for a, b in zip(one[i], d[i], strict=True))
    assert one[3][0].tolist() == ids[12:16]  # a.bin's last token, then b.bin's first three


def test_a_copy_carries_the_paths_not_the_tokens(tmp_path):
    data = tokens(_write(tmp_path / "t.bin", range(10_000)), 8)
    data[0]
    copy = pickle.loads(pickle.dumps(data))
    assert len(pickle.dumps(data)) < 2_000
    assert torch.equal(copy[100][1], data[100][1])


def test_the_stream_shuffles_and_shards_token_windows(tmp_path):
    data = tokens(_write(tmp_path / "t.bin", range(200)), 6)
    stream = DataStream(data, 4, 2, shuffle=True, seed=3, replicas=2)
    idx = stream.indices(5)
    (xs, ys, sizes), _ = stream.shards(5)
    assert sizes == [1, 1]
    assert xs[0].tolist() == [data[idx[0]][0].tolist()] and ys[1].tolist() == [data[idx[1]][1].tolist()]


@pytest.mark.parametrize(("args", "says"), [
    ({"path": "missing.bin", "seq_len": 4}, "missing.bin: no such file"),
    ({"path": "odd.bin", "seq_len": 4}, "odd.bin: 7 bytes is not a whole number of uint16 tokens (2 bytes each): "
                                        "wrong dtype for the file's size"),
    ({"path": "t.bin", "seq_len": 4, "dtype": "uint32"}, "wrong dtype for the file's size"),
    ({"path": "t.bin", "seq_len": 10}, "seq_len 10 is longer than the data: a window takes 11 tokens"),
    ({"path": "t.bin", "seq_len": 4, "dtype": "int16"}, "dtype 'int16' is not a token file's: expected uint16 or uint32"),
    ({"path": "shards/*.bin", "seq_len": 4}, "no files match 'shards/*.bin'"),
    ({"path": "t.bin", "seq_len": 0}, "seq_len 0 must be a whole number of tokens, at least 1"),
    ({"path": [], "seq_len": 4}, "expected a file, a glob, or a list of them"),
])
def test_bad_input_is_one_line(tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)  # a relative path is the job folder's: the factories run there
    _write(tmp_path / "t.bin", range(5))  # 10 bytes: 2.5 uint32 tokens
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        tokens(**args)
    assert says in str(e.value) and "\n" not in str(e.value)


def _lm_job(path: str, **more) -> dict:
    return job(TWO_STAGES, model={"factory": "tests.support.models:tiny_lm", "args": {"vocab": 32, "layers": 1}},
               loss="cross_entropy", data={"factory": "tokens", "args": {"path": path, "seq_len": 8, **more},
                                           "batch_size": 4})


@pytest.mark.parametrize(("path", "more", "says"), [
    ("missing.bin", {}, "missing.bin: no such file"),
    ("odd.bin", {}, "wrong dtype for the file's size"),
    ("t.bin", {"seq_len": 64}, "seq_len 64 is longer than the data"),
    ("t.bin", {"dtype": "int8"}, "dtype 'int8' is not a token file's"),
    ("shards/*.bin", {}, "no files match 'shards/*.bin'"),
])
def test_the_plan_refuses_bad_token_files_in_one_line(tmp_path, monkeypatch, path, more, says):
    # Where validate and run check the data (gpipe.coordinator.plan.job): SpecError, exit 2, before anything starts.
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "t.bin", np.arange(50) % 32)
    (tmp_path / "odd.bin").write_bytes(b"\0" * 1001)
    with pytest.raises(SpecError) as e:
        make_plan(parse_spec(yaml.safe_dump(_lm_job(path, **more))), tmp_path)
    assert str(e.value).startswith("data.args: tokens raised ") and says in str(e.value)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


@pytest.mark.parametrize(("where", "ids", "more", "says"), [
    # an id past a vocabulary too small for the data: which id, where, the vocabulary, as uint16
    ("data", np.arange(50) % 40, {}, ("token id 32 (token 32 of ", "read as uint16", "vocabulary of 32 ids",
                                      "(0: Embedding(32, 16))", "is data.args.dtype")),
    # uint16 ids read as uint32: pairs of them make ids far past any vocabulary
    ("data", np.arange(100) % 32, {"dtype": "uint32"}, ("token id 65536 (token 0 of ", "read as uint32",
                                                        "vocabulary of 32 ids")),
    ("eval.data", np.arange(50) % 40, {}, ("token id 32 (token 32 of ", "is eval.data.args.dtype")),
])
def test_ids_outside_the_model_s_vocabulary_are_one_line_naming_the_id_the_vocabulary_and_the_dtype(
        tmp_path, monkeypatch, where, ids, more, says):
    # Caught at validate, before the model runs into them (IndexError: index out of range in self).
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "bad.bin", ids)
    _write(tmp_path / "good.bin", np.arange(100) % 32)
    spec = _lm_job("bad.bin" if where == "data" else "good.bin", **more)
    if where == "eval.data":
        spec["eval"] = {"data": _lm_job("bad.bin")["data"], "every": 2}
    with pytest.raises(SpecError) as e:
        make_plan(parse_spec(yaml.safe_dump(spec)), tmp_path)
    line = str(e.value)
    assert line.startswith(f"{where}: the first batch's ") and all(s in line for s in says), line
    assert e.value.exit_code == 2 and "\n" not in line


def test_the_vocabulary_is_the_token_embedding_s_and_unknown_without_one():
    from gpipe.data.tokens import vocabulary
    from tests.support import models

    assert vocabulary(models.tiny_lm(vocab=32)) == (32, "0: Embedding(32, 16)")
    assert vocabulary(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None  # nothing checked
    # two embeddings: the larger (a token id below it may still be out of the token embedding's range; never
    # the other way round), unless the model says which (a Hugging Face model's get_input_embeddings)
    two = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Embedding(64, 4))
    assert vocabulary(two) == (64, "1: Embedding(64, 4)")
    pytest.importorskip("transformers")
    vocab, where = vocabulary(models.gpt2(vocab=40))  # positions: 64
    assert vocab == 40 and where.startswith("transformer.wte: ")


def test_token_files_serve_as_eval_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "train.bin", np.arange(100) % 32)
    _write(tmp_path / "val.bin", np.arange(41) % 32)
    spec = _lm_job("train.bin") | {"eval": {"data": _lm_job("val.bin")["data"], "every": 2}}
    plan = make_plan(parse_spec(yaml.safe_dump(spec)), tmp_path)
    assert len(plan.eval_dataset) == 5


@pytest.mark.parametrize("shuffle", [False, True])
def test_windows_read_through_few_open_files_equal_the_files(tmp_path, monkeypatch, shuffle):
    # The set maps nothing (validate --memory-mib and serve's validation count mapped files against their
    # cap) and keeps at most OPEN files open, whatever the files' count and size. Here 2 kept of 5 files.
    monkeypatch.setattr(gpipe.data.tokens, "OPEN", 2)
    ids = np.random.default_rng(0).integers(0, 60_000, 300)
    for k, part in enumerate(np.split(ids, [45, 45, 52, 160])):  # an empty file, and one shorter than a window
        _write(tmp_path / f"s{k}.bin", part)
    data = tokens(str(tmp_path / "s*.bin"), 10)
    for i in DataStream(data, 5, 1, shuffle, seed=1).indices(0) + list(range(len(data))):
        x, y = data[i]
        assert x.tolist() == ids[i * 10 : i * 10 + 10].tolist() and y.tolist() == ids[i * 10 + 1 : i * 10 + 11].tolist()
        assert len(data._files) <= 2
    assert data.read(44, 10).tolist() == ids[44:54].tolist()  # across the empty file and the short one
    assert data.read(0, 300).tolist() == ids.tolist()


def test_a_shortened_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "t.bin"
    data = tokens(_write(path, range(100)), 8)
    data[0]
    path.write_bytes(path.read_bytes()[:100])  # 50 tokens left
    assert data[5][0].tolist() == list(range(40, 48))
    with pytest.raises(OSError, match="t.bin: ends before token 81"):
        data[9]


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 65_537, 10**6 + 3, 10**7])
def test_the_shuffles_int32_permutation_is_the_int64_one(n):
    # The stream keeps its permutation as int32 (half the bytes of a set's worth of int64): the same draws,
    # so every batch is the one the int64 permutation made.
    for seed in (0, 5):
        want = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + 2))
        stream = DataStream(torch.utils.data.TensorDataset(torch.zeros(n)), 1, 1, shuffle=True, seed=seed)
        for k in {0, n // 3, n // 2, n - 1}:  # step 2n + k: epoch 2's item k
            assert stream.indices(2 * n + k) == [int(want[k])]
        assert stream._perm is not None and stream._perm[1].dtype == torch.int32
        assert torch.equal(stream._perm[1].long(), want)
