"""A job's code: what submit packs, and what serve and workers refuse to unpack (gpipe.service.code_archive).

In process; the runs through real processes are in tests/service/test_code_archive.py.
"""

from __future__ import annotations

import io
import os
import stat
import zipfile
from pathlib import Path

import pytest

from gpipe.service import code_archive
from gpipe.service.code_archive import CodeError, Store, pack, unpack


def folder_with_everything(root: Path) -> Path:
    """A job's folder, with what is code and what is not."""
    (root / "pkg").mkdir(parents=True)
    (root / "model.py").write_text("def build():\n    return 1\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "data.txt").write_text("abc")
    for skipped in (".git", "__pycache__", "pkg/__pycache__", ".venv", "myenv", "gpipe-state/job", "out/job",
                    "scratch/cache", "data"):
        (root / skipped).mkdir(parents=True)
        (root / skipped / "x").write_text("not code")
    (root / "myenv" / "pyvenv.cfg").write_text("home = /usr\n")  # a virtualenv of any name
    (root / "out" / "job" / "job.json").write_text("{}")  # a state dir of any name
    (root / "scratch" / "CACHEDIR.TAG").write_text(code_archive.CACHEDIR_TAG)
    (root / "model.pyc").write_bytes(b"\0")
    (root / "weights.ckpt").write_bytes(b"\0" * 10)
    (root / "link.py").symlink_to(root / "model.py")
    return root


def names(data: bytes) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(data)).namelist()


def test_pack_sends_the_code_and_leaves_out_what_is_not(tmp_path):
    folder = folder_with_everything(tmp_path / "job")
    data = pack(folder, exclude=["*.ckpt", "data/"])
    assert sorted(names(data)) == ["model.py", "pkg/__init__.py", "pkg/data.txt"]
    assert pack(folder, exclude=["*.ckpt", "data/"]) == data  # the same files, the same archive: one hash


def test_a_folder_too_large_is_refused_naming_the_limit_and_how_to_raise_it(tmp_path):
    (tmp_path / "big.bin").write_bytes(os.urandom(3 << 20))
    with pytest.raises(CodeError) as e:
        pack(tmp_path, limit=1 << 20)
    line = str(e.value)
    assert "\n" not in line and "limit is 1 MiB" in line and "default 50" in line and "--max-code-mib" in line


def test_an_unreadable_file_is_named(tmp_path, monkeypatch):
    (tmp_path / "secret.py").write_text("x")
    (tmp_path / "secret.py").chmod(0)
    if os.geteuid() == 0:  # root reads every file: its open fails as a user's would
        real_open = Path.open

        def refusing(self, *a, **kw):
            if self.name == "secret.py":
                raise PermissionError(13, "Permission denied", str(self))
            return real_open(self, *a, **kw)

        monkeypatch.setattr(Path, "open", refusing)
    with pytest.raises(CodeError, match="cannot read .*secret.py: Permission denied"):
        pack(tmp_path)


def archive(tmp_path: Path, members: list[tuple[str, bytes, int]]) -> Path:
    """A zip of (name, data, unix mode) members, written as an attacker would."""
    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data, mode in members:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return path


FILE = stat.S_IFREG | 0o644


@pytest.mark.filterwarnings("ignore:Duplicate name")  # the archive an attacker wrote
@pytest.mark.parametrize("members,why", [
    ([("../escape.py", b"x", FILE)], "not a path inside its folder"),
    ([("/etc/evil.py", b"x", FILE)], "not a path inside its folder"),
    ([("a/../../escape.py", b"x", FILE)], "not a path inside its folder"),
    ([("link.py", b"/etc/passwd", stat.S_IFLNK | 0o777)], "not a plain file"),
    ([("a.py", b"x", FILE), ("a.py", b"y", FILE)], "cannot unpack"),
])
def test_unpack_refuses_an_unsafe_archive_and_leaves_nothing(tmp_path, members, why):
    dest = tmp_path / "out" / "code"
    with pytest.raises(CodeError, match=why):
        unpack(archive(tmp_path, members), dest)
    assert not dest.exists() and list((tmp_path / "out").iterdir()) == []


def test_unpack_bounds_the_bytes_written_and_the_members(tmp_path, monkeypatch):
    bomb = archive(tmp_path, [("zeros.bin", b"\0" * (4 << 20), FILE)])  # a few KiB that inflate to 4 MiB
    assert bomb.stat().st_size < 64 << 10
    monkeypatch.setattr(code_archive, "MAX_UNPACKED_BYTES", 1 << 20)
    with pytest.raises(CodeError, match="unpacks to more than 1 MiB"):
        unpack(bomb, tmp_path / "bomb")
    many = archive(tmp_path, [(f"m{i}.py", b"", FILE) for i in range(5)])
    monkeypatch.setattr(code_archive, "MAX_MEMBERS", 4)
    with pytest.raises(CodeError, match="5 members, over 4"):
        unpack(many, tmp_path / "many")


def test_the_store_checks_the_size_the_hash_and_the_archive(tmp_path):
    store = Store(tmp_path / "store")
    folder = folder_with_everything(tmp_path / "job")
    data = pack(folder)
    up = store.upload(limit=1 << 20)
    for i in range(0, len(data), 100):
        up.add(data[i:i + 100])
    sha, size = up.finish()
    assert size == len(data) and (store.unpacked(sha) / "pkg" / "data.txt").read_text() == "abc"

    # Over the limit: refused, nothing kept.
    up = store.upload(limit=10)
    with pytest.raises(CodeError, match="limit of 0 MiB"):
        up.add(b"x" * 11)
    assert sorted(p.name for p in store.root.iterdir()) == sorted(["CACHEDIR.TAG", f"{sha}.zip", sha])

    # Damaged on disk: a fresh reader (serve restarted) refuses it by its hash.
    store.archive(sha).write_bytes(data[:-1] + b"!")
    with pytest.raises(CodeError, match="does not match its hash"):
        Store(store.root).unpacked(sha)

    # Not a zip at all.
    up = store.upload(limit=1 << 20)
    up.add(b"not a zip")
    bad, _ = up.finish()
    with pytest.raises(CodeError, match="not a readable zip archive"):
        store.unpacked(bad)

    # Bounded: all but the newest archives no job names are dropped, with their folders.
    up = store.upload(limit=1 << 20)
    up.add(pack(folder, exclude=["pkg"]))
    newest, _ = up.finish()
    os.utime(store.archive(newest), (2e9, 2e9))
    store.forget_unused({sha}, keep=1)
    assert sorted(p.name for p in store.root.iterdir()) == sorted(["CACHEDIR.TAG", f"{sha}.zip", sha, f"{newest}.zip"])


@pytest.mark.parametrize("member", [".", "./", "a/./b.py"])
def test_a_dot_member_is_refused_as_no_path_inside_the_folder(tmp_path, member):
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr(member, b"x")
    with pytest.raises(code_archive.CodeError, match="not a path inside its folder"):
        code_archive.unpack(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_archive_that_states_too_many_members_is_refused_before_its_directory_is_read(tmp_path):
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("m.py", b"x")
    data = bytearray(archive.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    data[end + 10:end + 12] = (code_archive.MAX_MEMBERS + 1).to_bytes(2, "little")
    archive.write_bytes(bytes(data))
    with pytest.raises(code_archive.CodeError, match="members, over"):
        code_archive.unpack(archive, tmp_path / "out")


def test_an_archive_whose_end_record_understates_its_directory_is_refused_while_walking_it(tmp_path, monkeypatch):
    """The end record claims 1 member, the directory holds many (before the fix zipfile parsed them all: 1.1M
    entries took 15 s and 620 MiB of serve): the walk stops past MAX_MEMBERS, naming the bound."""
    monkeypatch.setattr(code_archive, "MAX_MEMBERS", 50)
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for i in range(200):
            z.writestr(f"d{i}/", b"")
    data = bytearray(archive.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    data[end + 8:end + 12] = (1).to_bytes(2, "little") * 2  # entries on this disk, and in all: 1
    archive.write_bytes(bytes(data))
    seen: list[int] = []
    monkeypatch.setattr(zipfile.ZipFile, "_RealGetContents", lambda self: seen.append(1))
    with pytest.raises(CodeError, match="more than 50 members"):
        unpack(archive, tmp_path / "out")
    assert seen == []  # zipfile never parsed the directory
    # A count that is not the directory's, under the bound, is refused too; and the directory's size is bounded.
    monkeypatch.setattr(code_archive, "MAX_MEMBERS", 1000)
    with pytest.raises(CodeError, match="end record says 1 members, its directory holds 200"):
        unpack(archive, tmp_path / "out")
    monkeypatch.setattr(code_archive, "MAX_DIRECTORY_BYTES", 100)
    with pytest.raises(CodeError, match="directory is .* bytes, over 100"):
        unpack(archive, tmp_path / "out")
