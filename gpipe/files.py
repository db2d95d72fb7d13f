"""Files that are either whole or absent: written to a temporary name, fsynced, renamed.

A crash (of the process or the machine) leaves the old file or the new one,
never a torn one: the data is fsynced before the rename, and the directory
after it, so the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """An OSError raised inside without a file name gets `path` (a full disk's write says which file)."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (files created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` in place and fsync it (for files that something else commits, as a manifest)."""
    with naming(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Replace `path` with what `write(tmp)` writes to a temporary file next to it, atomically and durably.

    An OSError that names no file (a full disk) is raised naming `path`.
    """
    path = Path(path)
    with naming(path):
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        try:
            write(tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data`, atomically and durably."""
    atomic_write(path, lambda tmp: write_synced(tmp, data))


def json_bytes(obj: object, indent: int | None = 2, sort_keys: bool = False) -> bytes:
    """`obj` as JSON text ending in a newline."""
    return (json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n").encode()


def atomic_write_json(path: Path, obj: object, indent: int | None = 2, sort_keys: bool = False) -> None:
    """Replace `path` with `obj` as JSON, atomically and durably."""
    atomic_write_bytes(path, json_bytes(obj, indent, sort_keys))
