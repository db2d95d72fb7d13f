"""A job's code: its folder packed by `submit`, kept by serve, unpacked where it runs.

`submit` packs the job's folder (job.yaml's, or the spec's `working_dir`) into a
zip archive, leaving out what is no code (version control, virtualenvs, gpipe
state dirs, caches) and the spec's `exclude` patterns. The archive is the same
bytes for the same files (sorted, with fixed timestamps), so its SHA-256 names
it: serve keeps it under that name, and unpacks it for the validation and each
attempt; a worker fetches it by that name and checks the hash before it trusts
a byte. Every attempt, restart and resume imports from the same archive.

Unpacking trusts nothing in the archive: each member is a plain file or folder
whose path stays inside the destination (no absolute path, no `..`, no link),
the members are at most MAX_MEMBERS, and the bytes written at most
MAX_UNPACKED_BYTES whatever the headers claim (a zip bomb stops there). No
archive format that can carry code to execute on load (pickle) is involved.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import io
import os
import shutil
import stat
import tempfile
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath

from gpipe.errors import SpecError

DEFAULT_LIMIT_MIB = 50  # the archive's size: submit --max-code-mib, serve --max-code-mib
MAX_LIMIT_MIB = 1024
MAX_MEMBERS = 20_000
# The archive's central directory, in bytes: 20,000 entries of 46 bytes, a name and extra fields of some 300 more.
MAX_DIRECTORY_BYTES = 8 << 20
MAX_UNPACKED_BYTES = 1 << 30
CHUNK_BYTES = 1 << 20  # a piece of an archive on the wire
# Folders that are never a job's code; left out too: a folder with pyvenv.cfg (a virtualenv), a CACHEDIR.TAG
# (a cache, gpipe's code store among them), or gpipe job outputs (a state dir: <name>/job.json or metrics.jsonl).
SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".tox", ".nox", ".mypy_cache",
                          ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", "node_modules", "gpipe-state",
                          "gpipe-worker-logs"})
SKIPPED_SUFFIXES = (".pyc", ".pyo")
_STAMP = (1980, 1, 1, 0, 0, 0)  # every member's time: the same files give the same archive
CACHEDIR_TAG = "Signature: 8a477f597d28d172789f06886806bc55"  # bford.net/cachedir: a cache, never packed
_DONE = ".gpipe-unpacked"  # written last into an unpacked folder: it is whole


class CodeError(SpecError):
    """An archive that is too large, cannot be read, is unsafe or does not match its hash: exit 2."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK_BYTES):
            h.update(block)
    return h.hexdigest()


def limit_bytes(mib: int, flag: str) -> int:
    if not 1 <= mib <= MAX_LIMIT_MIB:
        raise SpecError(f"{flag}: {mib} is outside 1..{MAX_LIMIT_MIB} MiB")
    return mib << 20


# -- packing (submit) ---------------------------------------------------------------------


def _is_state_dir(d: Path) -> bool:
    with contextlib.suppress(OSError):
        for sub in d.iterdir():
            if (sub / "job.json").is_file() or (sub / "metrics.jsonl").is_file():
                return True
    return False


def _excluded(rel: str, patterns: Iterable[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(rel, p.rstrip("/")) or fnmatch.fnmatchcase(name, p.rstrip("/")) for p in patterns)


def files_of(folder: Path, exclude: Iterable[str] = ()) -> Iterator[tuple[str, Path]]:
    """(path in the archive, file) for each file packed, in sorted order; links are not followed."""
    patterns = list(exclude)
    for root, dirs, files in os.walk(folder, followlinks=False):
        here = Path(root)
        rel_root = here.relative_to(folder).as_posix()
        keep = []
        for d in sorted(dirs):
            rel = d if rel_root == "." else f"{rel_root}/{d}"
            p = here / d
            if (d in SKIPPED_DIRS or p.is_symlink() or _excluded(rel, patterns) or (p / "pyvenv.cfg").exists()
                    or (p / "CACHEDIR.TAG").exists() or (p / _DONE).exists() or _is_state_dir(p)):
                continue
            keep.append(d)
        dirs[:] = keep
        for f in sorted(files):
            rel = f if rel_root == "." else f"{rel_root}/{f}"
            p = here / f
            if f.endswith(SKIPPED_SUFFIXES) or p.is_symlink() or _excluded(rel, patterns) or not p.is_file():
                continue
            yield rel, p


def pack(folder: Path, exclude: Iterable[str] = (), limit: int = DEFAULT_LIMIT_MIB << 20,
         what: str = "working_dir") -> bytes:
    """The zip archive of `folder`; CodeError (one line) if it is over `limit` bytes or a file cannot be read."""
    if not folder.is_dir():
        raise CodeError(f"{what}: {folder} is not a folder")
    buf = io.BytesIO()
    count = 0
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for rel, path in files_of(folder, exclude):
            count += 1
            if count > MAX_MEMBERS:
                raise CodeError(f"{what}: {folder} has more than {MAX_MEMBERS:,} files to send; leave some out "
                                "with exclude: in the spec")
            try:
                size = path.stat().st_size
                if size > limit * 8:  # no need to compress it to know
                    raise CodeError(_too_large(folder, what, limit, f"{rel} alone is {size / 2**20:,.1f} MiB"))
                info = zipfile.ZipInfo(rel, _STAMP)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = (stat.S_IFREG | 0o644) << 16
                with path.open("rb") as src, z.open(info, "w") as dst:
                    shutil.copyfileobj(src, dst, CHUNK_BYTES)
            except OSError as e:
                raise CodeError(f"{what}: cannot read {path}: {e.strerror}") from None
            if buf.tell() > limit:
                raise CodeError(_too_large(folder, what, limit, f"{buf.tell() / 2**20:,.1f} MiB packed so far"))
    data = buf.getvalue()
    if len(data) > limit:
        raise CodeError(_too_large(folder, what, limit, f"{len(data) / 2**20:,.1f} MiB packed"))
    return data


def _too_large(folder: Path, what: str, limit: int, why: str) -> str:
    return (f"{what}: {folder} is too large to send with the job ({why}; the limit is {limit >> 20} MiB, "
            f"default {DEFAULT_LIMIT_MIB}): leave files out with exclude: in the spec, or raise it with "
            "submit --max-code-mib (and serve --max-code-mib)")


# -- unpacking (serve, workers) -------------------------------------------------------------


def _member_path(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if (not name or name.startswith("/") or "\\" in name or "\0" in name or p.is_absolute()
            or any(part in ("..", ".", "") for part in name.rstrip("/").split("/")) or not p.parts
            or ":" in p.parts[0]):
        raise CodeError(f"job code: the archive's member {name[:80]!r} is not a path inside its folder")
    return p


def unpack(archive: Path, dest: Path) -> None:
    """Unpack a zip archive into the new folder `dest` (made whole, or not at all); CodeError if it is unsafe."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        try:
            _unpack_into(archive, tmp)
        except (zipfile.BadZipFile, EOFError, zlib.error, NotImplementedError, RuntimeError, ValueError) as e:
            # a member that does not inflate, or is encrypted
            raise CodeError(f"job code: {archive.name} is not a readable zip archive ({e})") from None
        except OSError as e:  # a name twice, a file where a folder goes; or this disk's own trouble
            raise CodeError(f"job code: cannot unpack {archive.name}: {e}") from None
        (tmp / _DONE).write_text("")
        try:
            tmp.rename(dest)
        except OSError:  # unpacked meanwhile by another caller: theirs is as good
            if not (dest / _DONE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _members(archive: Path) -> int:
    """The archive's member count, walked in its central directory's bytes before zipfile parses it (each entry
    zipfile parses costs memory): CodeError past MAX_MEMBERS, past MAX_DIRECTORY_BYTES, for a zip64 archive
    (gpipe never writes one), or where the end record's count is not the directory's. The walk reads only
    each entry's fixed header and stops past MAX_MEMBERS, so a count the end record understates costs
    nothing more."""
    with archive.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - (22 + 0xFFFF)))  # the end record, behind at most a 64 KiB comment
        tail = f.read()
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or len(tail) < at + 22:
            raise zipfile.BadZipFile("no end of central directory record")
        count = int.from_bytes(tail[at + 10:at + 12], "little")
        length = int.from_bytes(tail[at + 12:at + 16], "little")
        offset = int.from_bytes(tail[at + 16:at + 20], "little")
        if count == 0xFFFF or 0xFFFFFFFF in (length, offset):
            raise CodeError("job code: a zip64 archive (submit never makes one): pack the folder again")
        if count > MAX_MEMBERS:
            raise CodeError(f"job code: the archive has {count:,} members, over {MAX_MEMBERS:,}")
        if length > MAX_DIRECTORY_BYTES:
            raise CodeError(f"job code: the archive's directory is {length:,} bytes, over {MAX_DIRECTORY_BYTES:,}")
        if offset + length > size - len(tail) + at:
            raise zipfile.BadZipFile("the central directory lies past its end record")
        f.seek(offset)
        directory = f.read(length)
    n = pos = 0
    while pos < len(directory):
        if directory[pos:pos + 4] != b"PK\x01\x02" or pos + 46 > len(directory):
            raise zipfile.BadZipFile(f"a damaged central directory entry at byte {pos}")
        name, extra, comment = (int.from_bytes(directory[pos + o:pos + o + 2], "little") for o in (28, 30, 32))
        pos += 46 + name + extra + comment
        n += 1
        if n > MAX_MEMBERS:
            raise CodeError(f"job code: the archive has more than {MAX_MEMBERS:,} members")
    if n != count:
        raise CodeError(f"job code: the archive's end record says {count:,} members, its directory holds {n:,}")
    return n


def _unpack_into(archive: Path, folder: Path) -> None:
    _members(archive)
    with zipfile.ZipFile(archive) as z:
        members = z.infolist()
        if len(members) > MAX_MEMBERS:
            raise CodeError(f"job code: the archive has {len(members):,} members, over {MAX_MEMBERS:,}")
        written = 0
        for m in members:
            rel = _member_path(m.filename)
            mode = m.external_attr >> 16
            if stat.S_ISLNK(mode) or (mode and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))):
                raise CodeError(f"job code: the archive's member {m.filename[:80]!r} is not a plain file")
            target = folder.joinpath(*rel.parts)
            if m.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(m) as src, target.open("xb") as dst:  # x: a name twice in the archive is refused
                while block := src.read(CHUNK_BYTES):
                    written += len(block)  # what is written, not what the headers claim
                    if written > MAX_UNPACKED_BYTES:
                        raise CodeError(f"job code: the archive unpacks to more than {MAX_UNPACKED_BYTES >> 20:,} MiB")
                    dst.write(block)


class Upload:
    """An archive coming in pieces: written to a temporary file, hashed on the way, named by its hash at the end."""

    def __init__(self, store: Store, limit: int):
        self.store, self.limit = store, limit
        self.hash, self.size = hashlib.sha256(), 0
        fd, name = tempfile.mkstemp(prefix=".upload.", dir=store.root)
        self.path, self.file = Path(name), os.fdopen(fd, "wb")

    def add(self, piece: bytes) -> None:
        self.size += len(piece)
        if self.size > self.limit:
            self.abort()
            raise CodeError(f"job code: over this coordinator's limit of {self.limit >> 20} MiB "
                            "(serve --max-code-mib)")
        self.hash.update(piece)
        self.file.write(piece)

    def finish(self) -> tuple[str, int]:
        """(the archive's SHA-256, its size), once it is stored under that name."""
        self.file.close()
        sha = self.hash.hexdigest()
        self.path.replace(self.store.archive(sha))
        return sha, self.size

    def abort(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)


class Store:
    """Archives by SHA-256: <root>/<sha256>.zip, and each unpacked once into <root>/<sha256>/."""

    def __init__(self, root: Path):
        self.root = root
        self.checked: set[str] = set()  # archives whose hash this process has checked

    def archive(self, sha256: str) -> Path:
        return self.root / f"{sha256}.zip"

    def has(self, sha256: str) -> bool:
        return self.archive(sha256).is_file()

    def upload(self, limit: int) -> Upload:
        """An archive to receive in pieces, at most `limit` bytes."""
        self.root.mkdir(parents=True, exist_ok=True)
        tag = self.root / "CACHEDIR.TAG"  # packing a folder that holds this one leaves it out (files_of)
        if not tag.exists():
            tag.write_text(CACHEDIR_TAG + "\n# gpipe's job code store: archives and their unpacked folders\n")
        return Upload(self, limit)

    def unpacked(self, sha256: str) -> Path:
        """The archive's folder, unpacked once; the archive's hash is checked first (once per process), so a
        damaged archive is CodeError, never imported."""
        path, dest = self.archive(sha256), self.root / sha256
        if sha256 not in self.checked:
            try:
                got = sha256_of(path)
            except OSError as e:
                raise CodeError(f"job code: cannot read {path}: {e.strerror}") from None
            if got != sha256:
                raise CodeError(f"job code: {path} does not match its hash (it is now {got[:12]}...): damaged")
            self.checked.add(sha256)
        if not (dest / _DONE).exists():  # unpacked whole or not at all: a killed unpack left only a temporary
            unpack(path, dest)
        return dest

    def forget_unused(self, used: set[str], keep: int) -> None:
        """Drop all but the `keep` newest archives not in `used`, with their folders: on serve, uploads no job
        names; on a worker, other jobs' code."""
        with contextlib.suppress(OSError):
            spare = sorted((p for p in self.root.glob("*.zip") if p.stem not in used),
                           key=lambda p: p.stat().st_mtime, reverse=True)
            for p in spare[keep:]:
                p.unlink(missing_ok=True)
                shutil.rmtree(self.root / p.stem, ignore_errors=True)
