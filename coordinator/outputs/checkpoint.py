"""Checkpoints on the coordinator's disk: written in the background, committed by a manifest, verified on load.

    <state-dir>/<name>/checkpoints/step-<N>/     N: the steps done; training resumes at step N
        stage-<K>.safetensors   the stage's tensors: weights (model/<name>), optimizer tensors
                                (optim/<param name>/<key>) and RNG state (rng/cpu, rng/cuda),
                                under the un-partitioned model's names (the layout: gpipe.state)
        stage-<K>.json          the stage's JSON state: optimizer hyper-parameters and non-tensor state
        checkpoint.json         the step, the balance, the data position, the RNG and LR schedule state
        MANIFEST.json           each file's size and sha256; written last

A step directory counts only once its manifest is in place: written to a
temporary name, fsynced, renamed, and the directory fsynced. Loading checks
every file against the manifest first, so a torn or damaged checkpoint is
never loaded; the previous good one is used, and one line says why.

Nothing here is pickled: tensors are safetensors, everything else JSON.
The safetensors files are written by `write_safetensors`, which streams each
tensor's bytes to disk and hashes them in the same pass, with no copy of the
tensor and without holding the GIL for the write, so training goes on while
a checkpoint is written. They are read with the safetensors library.

A stage's file may also come as a stream (StageStream: the header first, then
the data's pieces as the stage hands them over, gpipe.coordinator.attempt.state_stream), written
and hashed a piece at a time; and a loaded checkpoint keeps its tensors on disk
(Shard) until they are read a piece at a time, so neither saving nor resuming
holds a whole stage's state in this process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from gpipe import state as layout
from gpipe import stream
from gpipe.files import (
    atomic_write,
    atomic_write_bytes,
    fsync_dir,
    json_bytes,
    naming,
    write_synced,
)
from gpipe.state import StageState

# The layout on disk (the module's docstring draws it) is decided here alone: other modules ask these. The names
# the engine also reads (gpipe.weights: a checkpoint's weights back into a model) are gpipe.state's.
FORMAT = layout.CHECKPOINT_FORMAT
FOLDER = layout.CHECKPOINTS  # in a job's output folder
MANIFEST = layout.MANIFEST
META = "checkpoint.json"
STEP_RE = layout.STEP_RE


def folder(out: Path) -> Path:
    """Where the checkpoints of the job whose outputs are in `out` go."""
    return out / FOLDER


def step_dir(root: Path, step: int) -> Path:
    """The checkpoint taken after `step` steps, under `root` (a job's checkpoint folder)."""
    return root / f"step-{step}"


def step_of(d: Path) -> int | None:
    """The step that directory `d` holds the checkpoint of; None if it is no step-<N>."""
    m = STEP_RE.match(d.name)
    return int(m.group(1)) if m else None


def shard_files(k: int) -> tuple[str, str]:
    """Stage k's two files in a step directory: its tensors (safetensors) and its JSON state."""
    return layout.shard_files(k)



class BadCheckpoint(Exception):
    """A checkpoint that must not be loaded; the message says why in one line."""


class NoUsableCheckpoint(BadCheckpoint):
    """Checkpoints were committed, and none of them verifies; the message names each one and why."""


# -- writing ------------------------------------------------------------------------------


def _yield_cpu() -> None:
    """Lower this thread's CPU priority: where the coordinator shares cores with stages, they come first."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> tuple[int, str]:
    """Write `tensors` (CPU) as a safetensors file, fsynced; return (bytes, sha256).

    The header is the safetensors one: an 8-byte little-endian length, then
    JSON naming each tensor's dtype, shape and byte range, padded with spaces
    to a multiple of 8 so the data stays aligned.
    """
    head, _ = stream.header(tensors)
    order = sorted(tensors)
    views = [memoryview(head)]
    for name in order:
        t = tensors[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.numel():
            # The tensor's own memory: no copy.
            views.append(stream.numpy_bytes(t))
    # Hash on a second thread while this one writes: both let go of the GIL, so the two overlap.
    digest = hashlib.sha256()
    def hash_all() -> None:
        _yield_cpu()
        for v in views:
            digest.update(v)

    hasher = threading.Thread(target=hash_all, name="checkpoint-sha256")
    hasher.start()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        size = sum(stream.write_all(fd, v) for v in views)
        os.fsync(fd)
    finally:
        os.close(fd)
        hasher.join()
    return size, digest.hexdigest()


@dataclass
class StageStream:
    """A stage's state arriving in pieces: its safetensors header and JSON state first, then `pieces()`,
    the data region's bytes in order (uint8 CPU tensors), read as they are written."""

    header: bytes
    data_bytes: int
    json_state: dict[str, Any]
    pieces: Callable[[], Iterator[torch.Tensor]]


def write_stream(st: StageStream, path: Path) -> tuple[int, str]:
    """Write a stage's streamed state as a safetensors file, hashing each piece as it comes; (bytes, sha256)."""
    digest = hashlib.sha256(st.header)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        size = stream.write_all(fd, memoryview(st.header))
        for piece in st.pieces():
            view = stream.numpy_bytes(piece)
            digest.update(view)
            size += stream.write_all(fd, view)
        if size != len(st.header) + st.data_bytes:
            raise ValueError(f"{size - len(st.header)} bytes of data came for {st.data_bytes}")
        os.fsync(fd)
    finally:
        os.close(fd)
    return size, digest.hexdigest()


def _json(obj: Any) -> bytes:
    return json_bytes(obj, indent=1, sort_keys=True)


def _write_json(path: Path, obj: Any) -> tuple[int, str]:
    """Write `obj` to `path` (fsynced, not renamed: the manifest commits it); return (bytes, sha256)."""
    data = _json(obj)
    write_synced(path, data)
    return len(data), hashlib.sha256(data).hexdigest()


@dataclass
class Snapshot:
    """One checkpoint in memory: each stage's state, and the job's JSON state."""

    step: int
    stages: Sequence[StageState | StageStream]  # in memory, or streamed from the stages as it is written
    meta: dict[str, Any]
    stall_s: float = 0.0  # the longest any stage paused to copy its state out

    def model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights, under the un-partitioned model's names (a snapshot in memory only: a
        streamed one is read back from disk once written, with open_committed and export_weights)."""
        held = [st for st in self.stages if isinstance(st, StageState)]
        if len(held) != len(self.stages):
            raise ValueError(f"checkpoint step-{self.step} streams from the stages: read its weights from disk")
        return layout.model_state(held)


def write(root: Path, snap: Snapshot) -> tuple[Path, int]:
    """Write and commit `snap` under `root`; return its directory and its bytes on disk."""
    root.mkdir(parents=True, exist_ok=True)
    d = step_dir(root, snap.step)
    if d.exists():  # an earlier attempt's copy of this step, committed or not
        shutil.rmtree(d)
    d.mkdir()
    fsync_dir(root)
    files: dict[str, dict[str, Any]] = {}

    def write_stage(k: int) -> tuple[int, str]:
        st, path = snap.stages[k], d / shard_files(k)[0]
        with naming(path):
            return write_stream(st, path) if isinstance(st, StageStream) else write_safetensors(st.tensors, path)

    # Streamed stages are pulled at once, each from its own stage; in-memory ones written one after another.
    streamed = any(isinstance(st, StageStream) for st in snap.stages)
    with ThreadPoolExecutor(len(snap.stages) if streamed else 1, "checkpoint-stage") as pool:
        shards = list(pool.map(write_stage, range(len(snap.stages))))
    for k, st in enumerate(snap.stages):
        tensors, json_state = shard_files(k)
        files[tensors] = dict(zip(("bytes", "sha256"), shards[k], strict=True))
        size, sha = _write_json(d / json_state, st.json_state)
        files[json_state] = {"bytes": size, "sha256": sha}
    size, sha = _write_json(d / META, {"format": FORMAT, **snap.meta, "step": snap.step})
    files[META] = {"bytes": size, "sha256": sha}
    manifest = {"format": FORMAT, "step": snap.step, "stages": len(snap.stages), "files": files,
                "time_unix": time.time()}
    atomic_write_bytes(d / MANIFEST, _json(manifest))  # the commit: whole or absent, and durable
    return d, sum(f["bytes"] for f in files.values())


def committed(root: Path) -> list[int]:
    """Steps with a manifest in place (not yet verified), oldest first."""
    steps = []
    if root.is_dir():
        for d in root.iterdir():
            if (s := step_of(d)) is not None and (d / MANIFEST).exists():
                steps.append(s)
    return sorted(steps)


def prune(root: Path, keep: int) -> list[int]:
    """Delete all but the newest `keep` committed checkpoints, and torn ones older than the newest; return what went."""
    steps = committed(root)
    gone = steps[:-keep] if keep > 0 else steps
    newest = steps[-1] if steps else None
    for d in list(root.iterdir()) if root.is_dir() else []:
        s = step_of(d)
        if s is None:
            continue
        torn = not (d / MANIFEST).exists() and newest is not None and s < newest
        if s in gone or torn:
            shutil.rmtree(d, ignore_errors=True)
    return gone


class Writer:
    """Writes snapshots on a background thread, one at a time, in order.

    `submit` returns at once unless the previous snapshot is still being
    written: then it waits for it (the disk is slower than the checkpoints
    come). A failed write is raised by the next `submit`, `check` or
    `close`; the snapshots queued after it are not written.
    """

    def __init__(self, root: Path, keep: int, on_commit: Callable[[Snapshot, Path, int, float], None]):
        self.root, self.keep, self.on_commit = root, keep, on_commit
        self._q: queue.Queue[Snapshot | None] = queue.Queue(maxsize=1)
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        _yield_cpu()
        failed = False
        while (snap := self._q.get()) is not None:
            if failed:  # the attempt ends on the first failure: never pull a later snapshot from the stages
                self._q.task_done()
                continue
            try:
                t0 = time.perf_counter()
                d, size = write(self.root, snap)
                prune(self.root, self.keep)
                self.on_commit(snap, d, size, time.perf_counter() - t0)
            except BaseException as e:  # noqa: BLE001 - reported by submit, check and close
                self._error, failed = e, True
            finally:
                self._q.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, OSError):  # keep the errno and the path: the supervisor reads them
                raise OSError(e.errno, e.strerror or str(e), e.filename or str(self.root))
            raise OSError(f"could not write a checkpoint under {self.root}: {e}")

    def submit(self, snap: Snapshot) -> None:
        """Queue `snap`, waiting while the previous one is still being written."""
        self._raise()
        self._q.put(snap)

    def check(self) -> None:
        """Raise a failed write now (OSError): the attempt must not train on while its checkpoints fail."""
        self._raise()

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued writes; True if they finished within `timeout`. Raises a failed write."""
        done = threading.Event()
        first, self._closed = not self._closed, True

        def join() -> None:
            if first:
                self._q.put(None)
            self._thread.join()
            done.set()

        threading.Thread(target=join, daemon=True).start()
        finished = done.wait(timeout)
        if finished:
            self._raise()
        return finished


# -- reading ------------------------------------------------------------------------------


def _sha256(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def verify(d: Path) -> dict[str, Any]:
    """The manifest of step directory `d` once every file matches it; else BadCheckpoint saying why."""
    step = step_of(d)
    if step is None:
        raise BadCheckpoint("not a step-<N> directory")
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        raise BadCheckpoint(f"no {MANIFEST} (the save did not finish)") from None
    except (OSError, ValueError) as e:
        raise BadCheckpoint(f"{MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BadCheckpoint(f"{MANIFEST}: unknown format {manifest.get('format') if isinstance(manifest, dict) else manifest!r}")
    if manifest.get("step") != step:
        raise BadCheckpoint(f"{MANIFEST} names step {manifest.get('step')}, not {step}")
    files = manifest.get("files")
    stages = manifest.get("stages")
    if not isinstance(files, dict) or not isinstance(stages, int) or stages < 1:
        raise BadCheckpoint(f"{MANIFEST} lists no files or stages")
    needed = {META} | {name for k in range(stages) for name in shard_files(k)}
    if needed - set(files):
        raise BadCheckpoint(f"{MANIFEST} does not list {sorted(needed - set(files))[0]}")
    for name, want in sorted(files.items()):
        path = d / name
        if "/" in name or not path.is_file():
            raise BadCheckpoint(f"{name} is missing")
        size, sha = _sha256(path)
        if size != want.get("bytes"):
            raise BadCheckpoint(f"{name} has {size} bytes, the manifest says {want.get('bytes')} (truncated?)")
        if sha != want.get("sha256"):
            raise BadCheckpoint(f"{name}: sha256 does not match the manifest (the file is damaged)")
    return manifest


@dataclass
class Shard:
    """One stage's file of a verified checkpoint: its tensors' places (read a piece at a time) and its JSON state."""

    path: Path
    entries: dict[str, tuple[torch.dtype, list[int], int, int]]  # name -> (dtype, shape, start, end) in the data
    data_start: int
    json_state: dict[str, Any]

    @classmethod
    def open(cls, path: Path, json_path: Path) -> Shard:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            entries = stream.parse_header(f.read(n))
        return cls(path, entries, 8 + n, json.loads(json_path.read_text()))

    def pieces(self, name: str) -> Iterator[tuple[int, torch.Tensor]]:
        """Tensor `name`'s bytes as (byte offset, uint8 tensor) pieces of at most PIECE_BYTES, read one by one."""
        _, _, start, end = self.entries[name]
        with open(self.path, "rb", buffering=0) as f:
            for off in range(0, max(end - start, 1), stream.PIECE_BYTES):
                buf = torch.empty(min(stream.PIECE_BYTES, end - start - off), dtype=torch.uint8)
                f.seek(self.data_start + start + off)
                if f.readinto(buf.numpy()) != len(buf):  # type: ignore[arg-type]  # numpy types ndarray as a buffer on 3.12+ only
                    raise BadCheckpoint(f"{self.path.name}: {name} is cut short")
                yield off, buf

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name`, read whole."""
        dtype, shape, start, end = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        for off, piece in self.pieces(name):
            stream.write_piece(out, off, piece)
        return out


@dataclass
class Loaded:
    """A verified checkpoint: the files of the stages that wrote it (read as needed), and the job's JSON state."""

    step: int
    path: Path
    meta: dict[str, Any]
    shards: list[Shard]  # as the checkpoint's balance cut them
    _stages: list[StageState] | None = None

    @property
    def stages(self) -> list[StageState]:
        """Each stage's state, read whole into memory (for a checkpoint that fits this process)."""
        if self._stages is None:
            try:
                self._stages = [StageState(load_file(str(sh.path)), sh.json_state) for sh in self.shards]
            except (OSError, ValueError, SafetensorError) as e:
                raise BadCheckpoint(f"unreadable: {e}") from None
        return self._stages

    def model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights, under the un-partitioned model's names."""
        return layout.model_state(self.stages)

    def model_shapes(self) -> dict[str, torch.Tensor]:
        """The weights as meta tensors (their names, shapes and dtypes), under the un-partitioned model's names."""
        return {name: torch.empty(self.shards[k].entries[src][1], dtype=self.shards[k].entries[src][0],
                                  device="meta") for name, (k, src) in self.model_entries().items()}

    def model_entries(self) -> dict[str, tuple[int, str]]:
        """Weight name (un-partitioned) -> (the shard holding it, its name there)."""
        return {name.removeprefix(layout.MODEL): (k, name) for k, sh in enumerate(self.shards)
                for name in sh.entries if name.startswith(layout.MODEL)}


def load(d: Path) -> Loaded:
    """Verify the checkpoint in `d`, and read its JSON state and its files' headers (the tensors stay on disk)."""
    return open_committed(d, verify(d))


def open_committed(d: Path, manifest: dict[str, Any] | None = None) -> Loaded:
    """The checkpoint in `d`, not verified again (this process has just written it, or verified `manifest`)."""
    try:
        if manifest is None:
            manifest = json.loads((d / MANIFEST).read_text())
        meta = json.loads((d / META).read_text())
        shards = [Shard.open(*(d / name for name in shard_files(k))) for k in range(manifest["stages"])]
    except (OSError, ValueError, KeyError, struct.error) as e:
        raise BadCheckpoint(f"unreadable: {e}") from None
    return Loaded(manifest["step"], d, meta, shards)


def export_weights(ck: Loaded, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write the checkpoint's weights as one safetensors file (model.safetensors), atomically, a piece at a time,
    with `metadata` in its header, under the names the checkpoint holds them by (the model's own; a tied
    weight once)."""
    where, shapes = ck.model_entries(), ck.model_shapes()
    head, total = stream.header(shapes, metadata)

    def pieces() -> Iterator[torch.Tensor]:
        for name in sorted(where):
            k, src = where[name]
            for _, piece in ck.shards[k].pieces(src):
                yield piece

    def write(tmp: Path) -> None:
        write_stream(StageStream(head, total, {}, pieces), tmp)

    atomic_write(path, write)


def latest(root: Path, say: Callable[[str], None]) -> Loaded | None:
    """The newest checkpoint under `root` that verifies, each newer one passed over said in a line through `say`;
    None where none was committed (no step directory, or only saves that did not finish). Where some were
    committed and none verifies, NoUsableCheckpoint naming each one and why: starting over would drop them."""
    if not root.is_dir():
        return None
    dirs = []
    for d in root.iterdir():
        if (s := step_of(d)) is not None and d.is_dir():
            dirs.append((s, d))
    passed: list[tuple[str, BadCheckpoint]] = []  # (step directory, why), newest first
    for _, d in sorted(dirs, reverse=True):
        try:
            ck = load(d)
        except BadCheckpoint as e:
            passed.append((d.name, e))
            continue
        for name, why in passed:
            say(f"checkpoint {name} is not used: {why}")
        return ck
    if any((d / MANIFEST).exists() for _, d in dirs):
        each = "; ".join(f"{name} ({why})" for name, why in passed)
        raise NoUsableCheckpoint(f"none of the {len(passed)} checkpoint(s) in {root} can be used: {each}")
    for name, why in passed:  # saves that did not finish: no checkpoint was ever committed
        say(f"checkpoint {name} is not used: {why}")
    return None
