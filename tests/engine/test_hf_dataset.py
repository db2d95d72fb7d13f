"""Local Hugging Face datasets (gpipe.data.hf_dataset): the windows of the rows' ids, from a saved folder and from
files, the cache file, and one line per bad input."""

from __future__ import annotations

import pickle
import sys

import pytest
import torch
import yaml

import gpipe.data.hf_dataset
from gpipe.coordinator.plan.job import make_plan
from gpipe.coordinator.spec.job import parse_spec
from gpipe.data.hf_dataset import hf_dataset
from gpipe.errors import SpecError
from gpipe.factory import resolve
from tests.support.hf import TEXTS, dataset_folder, jsonl_files, tokenizer_folder
from tests.support.spec import TWO_STAGES, job

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tokenizer_folder(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def folder(tmp_path, monkeypatch, tok):
    """The job folder: the dataset saved in `wiki`, the tokenizer in `tok` (relative paths are its)."""
    monkeypatch.chdir(tmp_path)
    dataset_folder(tmp_path / "wiki")
    (tmp_path / "tok").symlink_to(tok)
    return tmp_path


def _stream(tok, texts, eos=False) -> list[int]:
    t = transformers.AutoTokenizer.from_pretrained(str(tok), local_files_only=True)
    return [i for text in texts for i in t(text, add_special_tokens=False)["input_ids"] + ([t.eos_token_id] if eos else [])]


def _items(data) -> list[tuple[list[int], list[int]]]:
    return [(x.tolist(), y.tolist()) for x, y in (data[i] for i in range(len(data)))]


@pytest.mark.parametrize("eos", [False, True])
def test_items_are_the_windows_of_the_rows_ids_one_after_another(folder, eos):
    ids = _stream(folder / "tok", TEXTS, eos)
    data = resolve("hf_dataset")(path="wiki", tokenizer="tok", seq_len=7, eos=eos, cache="cache")
    assert len(data) == (len(ids) - 1) // 7 > 20
    assert _items(data) == [(ids[i * 7 : i * 7 + 7], ids[i * 7 + 1 : i * 7 + 8]) for i in range(len(data))]
    x, y = data[0]
    assert x.dtype == y.dtype == torch.int64 and data.dtype.itemsize == 2  # 300 ids: uint16


def test_jsonl_and_parquet_files_make_the_saved_folders_windows(folder):
    saved = _items(hf_dataset("wiki", "tok", 5, cache="cache"))
    jsonl_files(folder / "json", files=3)
    assert _items(hf_dataset("json/*.jsonl", "tok", 5, cache="cache")) == saved
    rows = datasets.Dataset.from_dict({"body": TEXTS})
    half = len(TEXTS) // 2
    rows.select(range(half)).to_parquet(str(folder / "b.parquet"))
    rows.select(range(half, len(TEXTS))).to_parquet(str(folder / "a.parquet"))
    listed = hf_dataset(["b.parquet", "a.parquet"], "tok", 5, column="body", cache="cache")  # in the order given
    assert _items(listed) == saved


def test_a_dataset_dicts_split(folder):
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:8]}),
                          "validation": datasets.Dataset.from_dict({"text": TEXTS[8:]})}).save_to_disk("dict")
    for split, texts in [("train", TEXTS[:8]), ("validation", TEXTS[8:])]:
        ids = _stream(folder / "tok", texts)
        data = hf_dataset("dict", "tok", 4, split=split, cache="cache")
        assert _items(data)[-1] == (ids[len(data) * 4 - 4 : len(data) * 4], ids[len(data) * 4 - 3 : len(data) * 4 + 1])
    with pytest.raises(ValueError, match=r"^split 'test' is not in dict \(its splits: train, validation\)$"):
        hf_dataset("dict", "tok", 4, split="test", cache="cache")


def test_the_stream_is_tokenized_once_into_a_cache_file_a_new_dataset_makes_another(folder, monkeypatch):
    first = hf_dataset("wiki", "tok", 6, cache="cache")
    assert [f.name.split(".", 1)[1] for f in (folder / "cache").iterdir()] == ["uint16.bin"]  # nothing else left
    with monkeypatch.context() as m:  # a hit neither tokenizes nor imports the libraries
        m.setattr(gpipe.data.hf_dataset, "_build", None)
        m.setitem(sys.modules, "datasets", None)
        assert _items(hf_dataset("wiki", "tok", 6, cache="cache")) == _items(first)
        assert len(hf_dataset("wiki", "tok", 9, cache="cache")) == (first.tokens - 1) // 9  # the same file
    dataset_folder(folder / "wiki2", TEXTS[::-1])
    (folder / "wiki").rename(folder / "old")
    (folder / "wiki2").rename(folder / "wiki")  # the same path, saved anew
    again = hf_dataset("wiki", "tok", 6, cache="cache")
    ids = _stream(folder / "tok", TEXTS[::-1])
    assert again[0][0].tolist() == ids[:6] and len(list((folder / "cache").iterdir())) == 2


def test_a_cache_folder_inside_the_dataset_s_is_not_the_dataset_s(folder):
    first = hf_dataset("wiki", "tok", 6, cache="wiki/tokens")
    assert hf_dataset("wiki", "tok", 6, cache="wiki/tokens").files == first.files
    assert len(list((folder / "wiki" / "tokens").iterdir())) == 1


def test_a_copy_carries_the_path_not_the_tokens(folder):
    data = hf_dataset("wiki", "tok", 4, cache="cache")
    data[3]
    copy = pickle.loads(pickle.dumps(data))
    assert len(pickle.dumps(data)) < 2_000 and _items(copy) == _items(data)


@pytest.mark.parametrize(("args", "says"), [
    ({"path": "missing"}, "missing: no such dataset folder or file"),
    ({"path": "tok"}, "tok: not a folder that save_to_disk wrote (no state.json or dataset_dict.json in it): "
                      "give its .parquet or .jsonl files instead, e.g. tok/*.parquet"),
    ({"path": "shards/*.parquet"}, "no files match 'shards/*.parquet'"),
    ({"path": "notes.txt"}, "path 'notes.txt': expected a save_to_disk folder, or .parquet files, or .jsonl files"),
    ({"path": "bad.jsonl"}, "bad.jsonl: datasets cannot read it: "),
    ({"column": "body"}, "column 'body' is not in wiki (its columns: text, n)"),
    ({"column": "n"}, "column 'n' of wiki holds int64, not text"),
    ({"tokenizer": "nowhere"}, "tokenizer nowhere: no such folder"),
    ({"tokenizer": "wiki"}, "transformers cannot load a tokenizer from it: "),
    ({"tokenizer": "no-eos", "eos": True}, "no-eos has no eos token"),
    ({"seq_len": 5000}, "seq_len 5000 is longer than the data: a window takes 5001 tokens, wiki's column 'text' makes "),
    ({"seq_len": 0}, "seq_len 0 must be a whole number of tokens, at least 1"),
    ({"split": "test", "path": "part.jsonl"}, "split 'test': data files are one split (train)"),
])
def test_bad_input_is_one_line_and_leaves_no_file(folder, args, says):
    (folder / "notes.txt").write_text("some text")
    (folder / "bad.jsonl").write_text("{not json\n")
    jsonl_files(folder, files=1)[0].rename(folder / "part.jsonl")
    tokenizer_folder(folder / "no-eos", eos=False)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        hf_dataset(**({"path": "wiki", "tokenizer": "tok", "seq_len": 4, "cache": "cache"} | args))
    assert says in str(e.value) and "\n" not in str(e.value)
    assert not [f for f in (folder / "cache").glob("*") if not f.name.endswith(".bin")]  # no partial, no scratch


def test_without_the_datasets_package_it_says_what_to_install(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match=r"^hf_dataset needs the datasets package: pip install 'gpipe\[data\]'$"):
        hf_dataset("wiki", "tok", 4, cache="cache")


def test_the_plan_refuses_a_bad_dataset_in_one_line(folder):
    spec = job(TWO_STAGES, model={"factory": "tests.support.models:tiny_lm", "args": {"vocab": 300, "layers": 1}},
               loss="cross_entropy", data={"factory": "hf_dataset", "batch_size": 4,
                                           "args": {"path": "wiki", "tokenizer": "tok", "seq_len": 8,
                                                    "column": "body", "cache": "cache"}})
    with pytest.raises(SpecError) as e:
        make_plan(parse_spec(yaml.safe_dump(spec)), folder)
    assert str(e.value) == "data.args: hf_dataset raised ValueError: column 'body' is not in wiki (its columns: text, n)"
    assert e.value.exit_code == 2
    spec["data"]["args"]["column"] = "text"
    assert len(make_plan(parse_spec(yaml.safe_dump(spec)), folder).dataset) > 20
