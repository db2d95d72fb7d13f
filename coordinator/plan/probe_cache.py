"""The probes' answers kept for the next plan of an unchanged job: its model, spec and code (probes.json).

A plan runs the model before any worker starts: the probe (gpipe.memory.probe,
and a captured model's pieces on the first micro-batch), the layers' activation
memory (gpipe.memory.footprint), by_time's costs and the step time predicted.
That is tenths of a second for a small model and seconds for a language model,
paid again by every `run` of a job that has not changed. So an attempt keeps
their answers in <state-dir>/<name>/probes.json, as JSON (never pickle), under
a key that hashes everything they depend on:

- the spec, less the fields read only after the plan (its name, steps, logging,
  checkpoints, timeouts, restarts, priority);
- the job's code: every Python file its code archive holds (no virtualenv,
  cache or state folder, nor the spec's `exclude`), by content, and the files
  of the modules its factories, loss, optimizer and init hook come from;
- the versions of the libraries models are made of (torch, transformers ...:
  LIBRARIES) and of those the references come from, gpipe's version and the
  contents of its modules that measure (MEASURED_BY), Python's version, the
  host, its cores and the stages' threads;
- the data: the first micro-batch's structure, shapes and dtypes, and the size
  and time of each file or folder the data's arguments name.

A plan whose key differs measures afresh, and its answers replace the kept
ones; an answer that cannot be read back is measured again. A probe that fails
is never kept, so a job that failed its checks fails them again. A job folder
too large to hash (MAX_FILES, MAX_BYTES) keeps nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import socket
import sys
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from gpipe.coordinator.spec.job import JobSpec
from gpipe.files import atomic_write_json
from gpipe.service import code_archive

T = TypeVar("T")

FILE = "probes.json"
# The spec's fields that no probe reads: what happens after the plan.
AFTER_THE_PLAN = frozenset({
    "name", "steps", "log_every", "activation_meter_every", "trace_step", "checkpoint_every", "keep_checkpoints",
    "max_restarts", "restart_timeout_s", "start_timeout_s", "step_timeout_s", "peer_timeout_s", "priority",
    "keep_best", "exclude",
})
MAX_FILES, MAX_BYTES = 5000, 64 << 20  # a job folder hashed for its code: beyond these, nothing is kept
# gpipe's modules whose code measures the answers kept (the key holds their contents).
MEASURED_BY = ("gpipe.memory.probe", "gpipe.memory.footprint", "gpipe.memory.meter", "gpipe.memory.costs", "gpipe.balance",
               "gpipe.capture.graph", "gpipe.structure", "gpipe.wire", "gpipe.coordinator.plan.job",
               "gpipe.coordinator.plan.search", "gpipe.coordinator.plan.probe_cache")
# The libraries whose versions are part of the key, where loaded (with those the job's references come from).
LIBRARIES = ("torch", "numpy", "transformers", "tokenizers", "datasets", "safetensors", "accelerate", "peft", "timm",
             "torchvision", "torchtitan")
MAX_ENTRIES = 1000  # a data folder: its entries' sizes and times, at most these


class Probes:
    """One plan's probe answers: kept ones taken, new ones measured, all written back by `save`."""

    def __init__(self, path: Path | None, base: dict[str, Any] | None):
        """`path`: probes.json; `base`: the key's parts known before the model is built (None: keep nothing)."""
        self.path, self.base = path, base
        self.key: str | None = None
        self.kept: dict[str, Any] = {}  # the answers probes.json held for this key
        self.answers: dict[str, Any] = {}  # this plan's, as JSON
        self.reused: list[str] = []  # the answers taken from probes.json, by name

    @classmethod
    def off(cls) -> Probes:
        """Every probe measured, nothing kept (validate, the eval verb)."""
        return cls(None, None)

    @classmethod
    def of(cls, job_folder: Path, spec: JobSpec, code_dir: Path, threads: int) -> Probes:
        """The probes of `spec` planned with its code in `code_dir` for stages of `threads` threads, kept in
        `job_folder`/probes.json."""
        code = _code(code_dir, spec.exclude)
        if code is None:
            return cls.off()
        return cls(job_folder / FILE, {
            "spec": spec.model_dump(mode="json", exclude=set(AFTER_THE_PLAN)), "code": code,
            "gpipe": _own_files(), "python": sys.version, "host": socket.gethostname(),
            "machine": platform.machine(), "cores": len(os.sched_getaffinity(0)), "threads": threads,
            "data": {k: _named_files(v, code_dir) for k, v in _data_args(spec).items()},
        })

    def bind(self, sample: Any, spec: JobSpec, on_meta: bool) -> None:
        """Complete the key with the first micro-batch (`sample`: its inputs and targets), the modules the job's
        code came from (imported by now) and where the model was built; take the answers kept under it."""
        if self.base is None or self.path is None:
            return
        from gpipe import structure

        skeleton, tensors = structure.flatten(sample)
        parts = {**self.base, "on_meta": on_meta, "modules": _modules(spec), "libraries": _libraries(spec),
                 "sample": {"skeleton": skeleton, "tensors": [[list(t.shape), str(t.dtype)] for t in tensors]}}
        self.key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()
        with contextlib.suppress(OSError, ValueError):
            held = json.loads(self.path.read_text())
            if isinstance(held, dict) and held.get("key") == self.key and isinstance(held.get("answers"), dict):
                self.kept = held["answers"]

    def answer(self, name: str, measure: Callable[[], T], kind: Any = None,
               keep: Callable[[T], bool] = lambda value: True) -> T:
        """The answer kept under `name` for this key, read back as `kind` (a type: dataclasses, lists, tuples,
        dicts, optionals and plain values; None: as JSON gives it); else `measure()`, kept if `keep` says so
        (a measurement that failed is not). What `measure` raises is raised, and nothing is kept."""
        if name in self.kept:
            try:
                value = _decode(kind, self.kept[name]) if kind is not None else self.kept[name]
            except (TypeError, ValueError, KeyError, AttributeError):
                pass  # written by another version: measured again
            else:
                self.answers[name] = self.kept[name]
                self.reused.append(name)
                return typing.cast(T, value)
        value = measure()
        if self.key is not None and keep(value):
            self.answers[name] = _encode(value)
        return value

    def save(self) -> None:
        """Write this plan's answers (once its checks passed): probes.json, whole or not at all. A disk that
        refuses it costs the next plan its probes, nothing else."""
        if self.key is None or self.path is None or (self.answers == self.kept and self.kept):
            return
        with contextlib.suppress(OSError):
            atomic_write_json(self.path, {"key": self.key, "answers": self.answers})


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a probe's answer of type {type(value).__name__} is not kept")


def _decode(kind: Any, value: Any) -> Any:
    """`value` (JSON) as `kind`: a dataclass (by its fields' annotations), list[X], tuple[X, ...], tuple[X, Y],
    dict[K, V], X | None, int, float, bool, str, Any."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{kind} is not read back")
        return _decode(rest[0], value)
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        hints = typing.get_type_hints(kind)
        fields = [f for f in dataclasses.fields(kind) if f.init]
        if not isinstance(value, dict) or set(value) != {f.name for f in fields}:
            raise KeyError(f"{kind.__name__}: other fields")
        return kind(**{f.name: _decode(hints[f.name], value[f.name]) for f in fields})
    if origin is list:
        return [_decode(args[0], v) for v in _list(value)]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in _list(value))
        if len(_list(value)) != len(args):
            raise ValueError(f"{kind}: {len(value)} values")
        return tuple(_decode(a, v) for a, v in zip(args, value, strict=True))
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError("not a dict")
        return {_decode(args[0], k): _decode(args[1], v) for k, v in value.items()}
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, str):
        return int(value)  # a dict's key, as JSON wrote it
    if kind in (int, bool, str) and isinstance(value, kind):
        return value
    raise TypeError(f"{value!r} is not a {kind}")


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError("not a list")
    return value


def _code(code_dir: Path, exclude: list[str]) -> str | None:
    """A hash of the job's Python files, those its code archive holds (gpipe.service.code_archive.files_of:
    no virtualenv, cache or state folder, the spec's `exclude` left out), by their paths and contents; None for
    a folder beyond MAX_FILES or MAX_BYTES (or unreadable)."""
    h = hashlib.sha256()
    files = size = 0
    try:
        for rel, p in code_archive.files_of(code_dir, exclude):
            if not rel.endswith(".py"):
                continue
            data = p.read_bytes()
            files, size = files + 1, size + len(data)
            if files > MAX_FILES or size > MAX_BYTES:
                return None
            h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    except OSError:
        return None
    return h.hexdigest()


def _own_files() -> str:
    """The files of gpipe's modules that measure the answers, by content, and gpipe's version (a change to the
    probes' code is a change of key)."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    h = hashlib.sha256()
    with contextlib.suppress(PackageNotFoundError):
        h.update(version("gpipe").encode())
    for name in MEASURED_BY:
        with contextlib.suppress(OSError, ImportError, AttributeError, ValueError):
            origin = find_spec(name).origin  # type: ignore[union-attr]  # None: caught
            h.update(f"{name}\0".encode() + hashlib.sha256(Path(origin).read_bytes()).digest())  # type: ignore[arg-type]
    return h.hexdigest()


def _data_args(spec: JobSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"data": spec.data.args}
    if spec.eval is not None:
        out["eval"] = spec.eval.data.args
    return out


def _named_files(args: Any, code_dir: Path) -> list[Any]:
    """Each string among `args` that names a file or folder (relative to the job's folder, or absolute): its
    size and time; a folder's entries' (at most MAX_ENTRIES)."""
    out: list[Any] = []
    strings = [v for v in _strings(args) if v and len(v) < 4096]
    for s in strings:
        p = Path(s).expanduser()
        p = p if p.is_absolute() else code_dir / p
        with contextlib.suppress(OSError, ValueError):
            st = p.stat()
            entry: list[Any] = [s, st.st_size, st.st_mtime_ns]
            if p.is_dir():
                names = sorted(os.listdir(p))[:MAX_ENTRIES]
                entry.append([[n, (e := (p / n).stat()).st_size, e.st_mtime_ns] for n in names])
            out.append(entry)
    return out


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _modules(spec: JobSpec) -> dict[str, str]:
    """The files of the modules the job's references name (`module:name`), by content: its model, data, collate,
    loss, optimizer and init hook (gpipe's own short names are gpipe's files)."""
    out: dict[str, str] = {}
    for ref in _references(spec):
        if ":" not in ref:
            continue
        module = sys.modules.get(ref.split(":", 1)[0])
        file = getattr(module, "__file__", None)
        if file and file not in out:
            with contextlib.suppress(OSError):
                out[file] = hashlib.sha256(Path(file).read_bytes()).hexdigest()
    return out


def _libraries(spec: JobSpec) -> dict[str, str]:
    """The versions of the libraries models are made of (LIBRARIES) and of the packages the job's references
    come from, those loaded."""
    names = {*LIBRARIES, *(ref.split(":", 1)[0].split(".")[0] for ref in _references(spec) if ":" in ref)}
    out: dict[str, str] = {}
    for name in sorted(names):
        if isinstance(version := getattr(sys.modules.get(name), "__version__", None), str):
            out[name] = version
    return out


def _references(spec: JobSpec) -> list[str]:
    """The job's references (`module:name`, or gpipe's short names): model, data, collate, loss, optimizer, init
    hook, and the eval data's."""
    refs = [spec.model.factory, spec.data.factory, spec.data.collate, spec.loss_function, spec.init_hook,
            spec.optimizer.name]
    if spec.eval is not None:
        refs += [spec.eval.data.factory, spec.eval.data.collate]
    return [r for r in refs if r]
