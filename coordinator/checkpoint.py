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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import re
import shutil
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from gpipe import state as layout
from gpipe.files import atomic_write_bytes, fsync_dir, json_bytes, naming, write_synced
from gpipe.state import StageState

FORMAT = 1
MANIFEST = "MANIFEST.json"
META = "checkpoint.json"
STEP_RE = re.compile(r"^step-(\d+)$")

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class BadCheckpoint(Exception):
    """A checkpoint that must not be loaded; the message says why in one line."""


# -- writing ------------------------------------------------------------------------------


def _yield_cpu() -> None:
    """Lower this thread's CPU priority: where the coordinator shares cores with stages, they come first."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _write_all(fd: int, data: memoryview) -> int:
    written = 0
    while written < len(data):
        written += os.write(fd, data[written:])
    return written


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> tuple[int, str]:
    """Write `tensors` (CPU) as a safetensors file, fsynced; return (bytes, sha256).

    The header is the safetensors one: an 8-byte little-endian length, then
    JSON naming each tensor's dtype, shape and byte range, padded with spaces
    to a multiple of 8 so the data stays aligned.
    """
    header: dict[str, Any] = {}
    offset = 0
    order = sorted(tensors)
    for name in order:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    views = [memoryview(struct.pack("<Q", len(raw)) + raw)]
    for name in order:
        t = tensors[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.numel():
            # The tensor's own memory: no copy.
            views.append(memoryview(t.view(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]  # numpy types ndarray as a buffer on 3.12+ only
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
        size = sum(_write_all(fd, v) for v in views)
        os.fsync(fd)
    finally:
        os.close(fd)
        hasher.join()
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
    stages: list[StageState]
    meta: dict[str, Any]
    stall_s: float = 0.0  # the longest any stage paused to copy its state out

    def model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights, under the un-partitioned model's names."""
        return layout.model_state(self.stages)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def write(root: Path, snap: Snapshot) -> tuple[Path, int]:
    """Write and commit `snap` under `root`; return its directory and its bytes on disk."""
    root.mkdir(parents=True, exist_ok=True)
    d = step_dir(root, snap.step)
    if d.exists():  # an earlier attempt's copy of this step, committed or not
        shutil.rmtree(d)
    d.mkdir()
    fsync_dir(root)
    files: dict[str, dict[str, Any]] = {}
    for k, st in enumerate(snap.stages):
        with naming(d / f"stage-{k}.safetensors"):
            files[f"stage-{k}.safetensors"] = dict(zip(
                ("bytes", "sha256"), write_safetensors(st.tensors, d / f"stage-{k}.safetensors"), strict=True))
        size, sha = _write_json(d / f"stage-{k}.json", st.json_state)
        files[f"stage-{k}.json"] = {"bytes": size, "sha256": sha}
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
            m = STEP_RE.match(d.name)
            if m and (d / MANIFEST).exists():
                steps.append(int(m.group(1)))
    return sorted(steps)


def prune(root: Path, keep: int) -> list[int]:
    """Delete all but the newest `keep` committed checkpoints, and torn ones older than the newest; return what went."""
    steps = committed(root)
    gone = steps[:-keep] if keep > 0 else steps
    newest = steps[-1] if steps else None
    for d in list(root.iterdir()) if root.is_dir() else []:
        m = STEP_RE.match(d.name)
        if not m:
            continue
        s = int(m.group(1))
        torn = not (d / MANIFEST).exists() and newest is not None and s < newest
        if s in gone or torn:
            shutil.rmtree(d, ignore_errors=True)
    return gone


class Writer:
    """Writes snapshots on a background thread, one at a time, in order.

    `submit` returns at once unless the previous snapshot is still being
    written: then it waits for it (the disk is slower than the checkpoints
    come). A failed write is raised by the next
    `submit` or by `close`.
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
        while (snap := self._q.get()) is not None:
            try:
                t0 = time.perf_counter()
                d, size = write(self.root, snap)
                prune(self.root, self.keep)
                self.on_commit(snap, d, size, time.perf_counter() - t0)
            except BaseException as e:  # noqa: BLE001 - reported by submit/close
                self._error = e
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
    m = STEP_RE.match(d.name)
    if not m:
        raise BadCheckpoint("not a step-<N> directory")
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        raise BadCheckpoint(f"no {MANIFEST} (the save did not finish)") from None
    except (OSError, ValueError) as e:
        raise BadCheckpoint(f"{MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BadCheckpoint(f"{MANIFEST}: unknown format {manifest.get('format') if isinstance(manifest, dict) else manifest!r}")
    if manifest.get("step") != int(m.group(1)):
        raise BadCheckpoint(f"{MANIFEST} names step {manifest.get('step')}, not {m.group(1)}")
    files = manifest.get("files")
    stages = manifest.get("stages")
    if not isinstance(files, dict) or not isinstance(stages, int) or stages < 1:
        raise BadCheckpoint(f"{MANIFEST} lists no files or stages")
    needed = {META} | {f"stage-{k}.{ext}" for k in range(stages) for ext in ("safetensors", "json")}
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
class Loaded:
    """A verified checkpoint: the state of each stage that wrote it, and the job's JSON state."""

    step: int
    path: Path
    meta: dict[str, Any]
    stages: list[StageState]  # as the checkpoint's balance cut them

    def model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights, under the un-partitioned model's names."""
        return layout.model_state(self.stages)


def load(d: Path) -> Loaded:
    """Verify, then read, the checkpoint in `d`."""
    manifest = verify(d)
    stages = []
    try:
        meta = json.loads((d / META).read_text())
        for k in range(manifest["stages"]):
            tensors = load_file(str(d / f"stage-{k}.safetensors"))
            stages.append(StageState(tensors, json.loads((d / f"stage-{k}.json").read_text())))
    except (OSError, ValueError, SafetensorError) as e:
        raise BadCheckpoint(f"unreadable: {e}") from None
    return Loaded(manifest["step"], d, meta, stages)


def latest(root: Path, say: Callable[[str], None]) -> Loaded | None:
    """The newest checkpoint under `root` that verifies; each one passed over gets a line through `say`."""
    if not root.is_dir():
        return None
    dirs = []
    for d in root.iterdir():
        m = STEP_RE.match(d.name)
        if m and d.is_dir():
            dirs.append((int(m.group(1)), d))
    for _, d in sorted(dirs, reverse=True):
        try:
            return load(d)
        except BadCheckpoint as e:
            say(f"checkpoint {d.name} is not used: {e}")
    return None
