"""The checkpoint format on real files: safetensors the library reads, a manifest that catches damage, pruning."""

from __future__ import annotations

import errno
import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpipe.coordinator.outputs import checkpoint
from gpipe.coordinator.spec.job import parse_spec
from gpipe.errors import SpecError
from gpipe.state import StageState


def sample() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model/0.weight": torch.randn(5, 3, generator=g),
        "model/0.bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "model/1.half": torch.randn(2, 2, generator=g).half(),
        "model/1.double": torch.randn(4, generator=g).double(),
        "model/2.mask": torch.tensor([True, False, True]),
        "model/2.count": torch.tensor(7, dtype=torch.int64),  # 0-dim
        "model/2.empty": torch.zeros(0, 4),
        "optim/0.weight/exp_avg": torch.randn(3, 5, generator=g).t(),  # not contiguous
        "rng/cpu": torch.get_rng_state(),
    }


def test_shards_are_safetensors_the_library_reads_bit_for_bit(tmp_path):
    t = sample()
    size, sha = checkpoint.write_safetensors(t, tmp_path / "x.safetensors")
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert size == len(raw) and sha == hashlib.sha256(raw).hexdigest()
    got = load_file(str(tmp_path / "x.safetensors"))
    assert set(got) == set(t)
    for k in t:
        assert got[k].dtype == t[k].dtype and got[k].shape == t[k].shape and torch.equal(got[k], t[k]), k
    assert (8 + int.from_bytes(raw[:8], "little")) % 8 == 0  # the data is aligned


def snap(step: int, scale: float = 1.0) -> checkpoint.Snapshot:
    stages = [StageState({"model/0.weight": torch.full((4, 4), scale), "rng/cpu": torch.get_rng_state()},
                         {"param_groups": [{"lr": 0.1}], "optimizer_state": {}}),
              StageState({"model/1.weight": torch.full((4,), -scale), "optim/1.weight/momentum_buffer": torch.ones(4)},
                         {"param_groups": [{"lr": 0.1}], "optimizer_state": {}})]
    return checkpoint.Snapshot(step, stages, {"balance": [1, 1], "data": {"dataset_len": 10}})


def test_the_layout_has_one_home_and_the_supervisor_reads_it(tmp_path):
    from gpipe.coordinator.supervisor.jobs import newest_committed

    root = checkpoint.folder(tmp_path)
    d, _ = checkpoint.write(root, snap(4))
    assert checkpoint.step_of(d) == 4 and d == checkpoint.step_dir(root, 4)
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [checkpoint.MANIFEST, checkpoint.META, *checkpoint.shard_files(0), *checkpoint.shard_files(1)])
    checkpoint.step_dir(root, 9).mkdir()  # torn: no manifest
    (root / "step-x").mkdir()  # not a checkpoint
    (root / "step-12.tmp").mkdir()
    assert checkpoint.step_of(root / "step-x") is None and checkpoint.step_of(root / "step-12.tmp") is None
    assert checkpoint.committed(root) == [4] and newest_committed(tmp_path) == 4
    assert newest_committed(tmp_path / "nothing") == 0


def test_a_written_checkpoint_verifies_and_loads(tmp_path):
    d, size = checkpoint.write(tmp_path, snap(4, 2.0))
    assert d == tmp_path / "step-4" and size == sum(f.stat().st_size for f in d.iterdir() if f.name != "MANIFEST.json")
    manifest = checkpoint.verify(d)
    assert manifest["step"] == 4 and set(manifest["files"]) == {
        "stage-0.safetensors", "stage-0.json", "stage-1.safetensors", "stage-1.json", "checkpoint.json"}
    ck = checkpoint.load(d)
    assert ck.step == 4 and ck.meta["balance"] == [1, 1] and ck.meta["step"] == 4
    assert torch.equal(ck.model_state()["0.weight"], torch.full((4, 4), 2.0))
    assert torch.equal(ck.stages[1].optim_tensors_for({"1"})["optim/1.weight/momentum_buffer"], torch.ones(4))
    assert "rng/cpu" in ck.stages[0].rng() and not ck.stages[1].rng()
    assert ck.stages[0].param_groups == [{"lr": 0.1}]
    assert not list(d.glob("*.tmp")) and not list(d.glob(".*"))


def truncate(d: Path) -> None:
    f = d / "stage-1.safetensors"
    f.write_bytes(f.read_bytes()[:-3])


def flip(d: Path) -> None:
    f = d / "stage-0.safetensors"
    b = bytearray(f.read_bytes())
    b[-1] ^= 1
    f.write_bytes(b)


def garble_manifest(d: Path) -> None:
    (d / "MANIFEST.json").write_text('{"format": 1, "step": ')


def wrong_step(d: Path) -> None:
    m = json.loads((d / "MANIFEST.json").read_text())
    m["step"] = 3
    (d / "MANIFEST.json").write_text(json.dumps(m))


DAMAGE = {
    "truncated": (truncate, "stage-1.safetensors has"),
    "flipped": (flip, "stage-0.safetensors: sha256 does not match the manifest (the file is damaged)"),
    "no manifest": (lambda d: (d / "MANIFEST.json").unlink(), "no MANIFEST.json (the save did not finish)"),
    "garbled manifest": (garble_manifest, "MANIFEST.json is not valid JSON"),
    "manifest of another step": (wrong_step, "MANIFEST.json names step 3, not 4"),
    "missing shard": (lambda d: (d / "stage-1.json").unlink(), "stage-1.json is missing"),
    "emptied meta": (lambda d: (d / "checkpoint.json").write_text("{}"), "checkpoint.json has 2 bytes"),
}


@pytest.mark.parametrize("name", DAMAGE)
def test_damage_is_caught_and_the_previous_checkpoint_is_used(tmp_path, name):
    damage, why = DAMAGE[name]
    checkpoint.write(tmp_path, snap(2, 1.0))
    checkpoint.write(tmp_path, snap(4, 2.0))
    damage(tmp_path / "step-4")
    with pytest.raises(checkpoint.BadCheckpoint) as e:
        checkpoint.verify(tmp_path / "step-4")
    assert why in str(e.value)
    said: list[str] = []
    ck = checkpoint.latest(tmp_path, said.append)
    assert ck is not None and ck.step == 2 and torch.equal(ck.model_state()["0.weight"], torch.full((4, 4), 1.0))
    assert len(said) == 1 and said[0].startswith("checkpoint step-4 is not used: ") and why in said[0]


def test_no_committed_checkpoint_is_none(tmp_path):
    assert checkpoint.latest(tmp_path / "absent", print) is None
    checkpoint.write(tmp_path, snap(2))
    (tmp_path / "step-2" / checkpoint.MANIFEST).unlink()  # a save that did not finish is no checkpoint
    said: list[str] = []
    assert checkpoint.latest(tmp_path, said.append) is None and len(said) == 1


def test_committed_checkpoints_none_of_which_verifies_are_named_not_passed_over(tmp_path):
    checkpoint.write(tmp_path, snap(2))
    checkpoint.write(tmp_path, snap(4))
    flip(tmp_path / "step-2")
    (tmp_path / "step-4" / checkpoint.MANIFEST).unlink()
    said: list[str] = []
    with pytest.raises(checkpoint.NoUsableCheckpoint) as e:
        checkpoint.latest(tmp_path, said.append)
    assert said == []  # the error names them all, in one line
    assert "\n" not in str(e.value) and "step-4 (no MANIFEST.json" in str(e.value)
    assert "step-2 (stage-0.safetensors: sha256 does not match" in str(e.value)


def test_prune_keeps_the_newest_and_drops_torn_older_ones(tmp_path):
    for s in (2, 4, 6, 8):
        checkpoint.write(tmp_path, snap(s))
    (tmp_path / "step-5").mkdir()  # torn, older than the newest: goes
    (tmp_path / "step-10").mkdir()  # being written now: stays
    assert checkpoint.prune(tmp_path, 2) == [2, 4]
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step-10", "step-6", "step-8"]


def test_the_writer_commits_in_the_background_and_reports_failures(tmp_path):
    seen = []
    w = checkpoint.Writer(tmp_path / "ck", 2, lambda snap, d, size, s: seen.append((snap.step, d.name)))
    for s in (1, 2, 3):
        w.submit(snap(s))
    assert w.close(timeout=30)
    assert seen == [(1, "step-1"), (2, "step-2"), (3, "step-3")]
    assert checkpoint.committed(tmp_path / "ck") == [2, 3]

    (tmp_path / "file").write_text("not a directory")
    w = checkpoint.Writer(tmp_path / "file", 2, lambda *a: None)
    w.submit(snap(1))
    with pytest.raises(OSError) as failed:
        w.close(timeout=30)
    assert failed.value.errno == errno.EEXIST and failed.value.filename.endswith("file")  # what and where


def test_after_a_failed_write_the_writer_says_so_at_once_and_pulls_nothing_more(tmp_path):
    """A failed write must end the attempt: `check` raises it while training waits, and a snapshot queued
    behind it is never pulled from its stages (they may be waiting on the failed one: pulling would hang)."""
    go, pulled = threading.Event(), []

    def failing():
        go.wait(30)
        raise OSError(errno.ENOSPC, "No space left on device")
        yield

    def later():
        pulled.append(True)
        yield from ()

    w = checkpoint.Writer(tmp_path / "ck", 2, lambda *a: None)
    w.submit(checkpoint.Snapshot(1, [checkpoint.StageStream(b"", 0, {}, failing)], {}))
    deadline = time.monotonic() + 30
    while w._q.qsize() and time.monotonic() < deadline:  # the writer took it, and waits on its pieces
        time.sleep(0.01)
    w.submit(checkpoint.Snapshot(2, [checkpoint.StageStream(b"", 0, {}, later)], {}))  # queued behind it
    w.check()  # nothing failed yet
    go.set()
    while time.monotonic() < deadline:
        try:
            w.check()
        except OSError as e:
            assert e.errno == errno.ENOSPC and "step-1" in e.filename
            break
        time.sleep(0.01)
    else:
        pytest.fail("check never raised the failed write")
    assert w.close(timeout=30) and pulled == []


def test_spec_fields():
    base = ("name: j\nmodel: {factory: mlp}\nstages: 1\ndata: {factory: random_regression, batch_size: 4}\n"
            "optimizer: {name: sgd, lr: 0.1}\nsteps: 3\n")
    s = parse_spec(base)
    assert (s.checkpoint_every, s.keep_checkpoints, s.max_restarts, s.restart_timeout_s) == (100, 3, 3, 600.0)
    assert parse_spec(base + "checkpoint_every: null\n").checkpoint_every is None
    for extra, msg in [("keep_checkpoints: 1", "keep_checkpoints: must be an integer between 2 and 1000, got 1"),
                       ("checkpoint_every: 0", "checkpoint_every: must be an integer between 1 and 1000000000, got 0"),
                       ("max_restarts: -1", "max_restarts: must be an integer between 0 and 100, got -1")]:
        with pytest.raises(SpecError) as e:
            parse_spec(base + extra + "\n")
        assert str(e.value) == msg
