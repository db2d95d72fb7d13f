"""`run`'s private folder and its job lock, in process: another local user's folder, a link or an open mode is
refused, naming the folder; a lock file removed by its last holder is never held twice. Each case failed
before the fix (the folder was taken as found; the lock followed links and counted on a removed file)."""

from __future__ import annotations

import os
import stat

import pytest

from gpipe.coordinator.outputs import folder
from gpipe.errors import SpecError


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    return tmp_path


def test_a_missing_folder_is_made_private(tmpdir_env):
    d = folder.private_folder()
    st = os.lstat(d)
    assert d.parent == tmpdir_env and stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert folder.private_folder() == d  # and taken again as it is


@pytest.mark.parametrize("squat, field", [
    (lambda d: (d.mkdir(), d.chmod(0o777)), "mode 0777"),
    (lambda d: (d.mkdir(), d.chmod(0o750)), "mode 0750"),
    (lambda d: d.symlink_to(d.parent / "elsewhere", target_is_directory=True), "is a link"),
    (lambda d: d.write_text("x"), "is not a folder"),
])
def test_a_folder_others_could_change_is_refused(tmpdir_env, squat, field):
    (tmpdir_env / "elsewhere").mkdir()
    d = tmpdir_env / f"gpipe-run-{os.getuid()}"
    squat(d)
    with pytest.raises(SpecError) as e:
        folder.private_folder()
    assert str(d) in str(e.value) and field in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user owns takes root")
def test_another_user_s_folder_is_refused(tmpdir_env):
    d = tmpdir_env / f"gpipe-run-{os.getuid()}"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)  # nobody's, mode 0700 as ours would be
    with pytest.raises(SpecError, match="belongs to uid 65534"):
        folder.private_folder()


def test_the_lock_never_follows_a_link(tmpdir_env, tmp_path):
    target = tmp_path / "victim"
    lock = tmp_path / "job.lock"
    lock.symlink_to(target)
    with pytest.raises(OSError):
        folder._lock(lock)
    assert not target.exists()


def test_a_lock_on_a_removed_file_is_taken_again_on_the_new_one(tmpdir_env, monkeypatch):
    """The race: B opens the lock file, A lets go (removes it, closes), C makes a new one and locks it; B's
    flock on the removed file then succeeds. B must see that and lock the file the path names now."""
    path = tmpdir_env / "job.lock"
    real_flock = folder.fcntl.flock
    held: list[int] = []
    raced: list[bool] = []

    def racing_flock(fd, op):  # between B's open and its flock: A removes the file, C locks a new one
        if not raced:
            raced.append(True)
            path.unlink()
            c = folder._lock(path)
            assert c is not None
            held.append(c)
        return real_flock(fd, op)

    monkeypatch.setattr(folder.fcntl, "flock", racing_flock)
    b = folder._lock(path)
    monkeypatch.setattr(folder.fcntl, "flock", real_flock)
    assert b is None  # C holds the file the path names: B is told it is busy, not given a dead lock
    os.close(held[0])


def test_the_job_lock_is_one_holder_at_a_time(tmpdir_env, tmp_path):
    with folder.running("j", tmp_path / "state"):
        with pytest.raises(SpecError, match="running already"):
            with folder.running("j", tmp_path / "state"):
                pass
    with folder.running("j", tmp_path / "state"):  # let go: taken again
        pass
