"""Checkpoints on the coordinator's disk: written in the background, committed by a manifest, verified on load.

    <state-dir>/<name>/checkpoints/step-<N>/     N: the steps done; training resumes at step N
        stage-<K>.safetensors   the stage's weights (model/<name>), optimizer tensors
                                (optim/<param name>/<key>) and RNG state (rng/cpu, rng/cuda),
                                under the un-partitioned model's names
        stage-<K>.json          the stage's optimizer hyper-parameters and non-tensor state
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _write_json(path: Path, obj: Any) -> tuple[int, str]:
    data = (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(data), hashlib.sha256(data).hexdigest()


@dataclass
class Snapshot:
    """One checkpoint in memory: per stage, its tensors and its JSON state; and the job's JSON state."""

    step: int
    stages: list[tuple[dict[str, torch.Tensor], dict[str, Any]]]
    meta: dict[str, Any]
    stall_s: float = 0.0  # the longest any stage paused to copy its state out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for tensors, _ in self.stages for t in tensors.values())

    def model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights, under the un-partitioned model's names."""
        out: dict[str, torch.Tensor] = {}
        for tensors, _ in self.stages:
            out.update({k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")})
        return out


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def write(root: Path, snap: Snapshot) -> tuple[Path, int]:
    """Write and commit `snap` under `root`; return its directory and its bytes on disk."""
    root.mkdir(parents=True, exist_ok=True)
    d = step_dir(root, snap.step)
    if d.exists():  # an earlier attempt's copy of this step, committed or not
        shutil.rmtree(d)
    d.mkdir()
    _fsync_dir(root)
    files: dict[str, dict[str, Any]] = {}
    for k, (tensors, state) in enumerate(snap.stages):
        for name, (size, sha) in (
            (f"stage-{k}.safetensors", write_safetensors(tensors, d / f"stage-{k}.safetensors")),
            (f"stage-{k}.json", _write_json(d / f"stage-{k}.json", state)),
        ):
            files[name] = {"bytes": size, "sha256": sha}
    size, sha = _write_json(d / META, {"format": FORMAT, **snap.meta, "step": snap.step})
    files[META] = {"bytes": size, "sha256": sha}
    manifest = {"format": FORMAT, "step": snap.step, "stages": len(snap.stages), "files": files,
                "time_unix": time.time()}
    tmp = d / (MANIFEST + ".tmp")
    _write_json(tmp, manifest)
    os.replace(tmp, d / MANIFEST)
    _fsync_dir(d)
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
    come), and says how long it waited. A failed write is raised by the next
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
            what = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror else str(e)
            raise OSError(f"could not write a checkpoint under {self.root}: {what}")

    def submit(self, snap: Snapshot) -> float:
        """Queue `snap`; return the seconds spent waiting for the previous write."""
        self._raise()
        t0 = time.perf_counter()
        self._q.put(snap)
        return time.perf_counter() - t0

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
    """A verified checkpoint: the merged tensors of every stage, and the JSON state."""

    step: int
    path: Path
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]  # model/..., optim/..., over all stages
    stage_states: list[dict[str, Any]]
    rng: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per stage: rng/cpu, rng/cuda

    def model_state(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("model/"): v for k, v in self.tensors.items() if k.startswith("model/")}


def load(d: Path) -> Loaded:
    """Verify, then read, the checkpoint in `d`."""
    manifest = verify(d)
    tensors: dict[str, torch.Tensor] = {}
    rng: list[dict[str, torch.Tensor]] = []
    states = []
    try:
        meta = json.loads((d / META).read_text())
        for k in range(manifest["stages"]):
            part = load_file(str(d / f"stage-{k}.safetensors"))
            rng.append({n: t for n, t in part.items() if n.startswith("rng/")})
            tensors.update({n: t for n, t in part.items() if not n.startswith("rng/")})
            states.append(json.loads((d / f"stage-{k}.json").read_text()))
    except (OSError, ValueError, SafetensorError) as e:
        raise BadCheckpoint(f"unreadable: {e}") from None
    return Loaded(manifest["step"], d, meta, tensors, states, rng)


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
