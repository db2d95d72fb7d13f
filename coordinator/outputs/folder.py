"""A job's output directory, <state-dir>/<name>/ (no torch here: the CLI's parent process stays light)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gpipe.errors import SpecError

TENSORBOARD = "tensorboard"  # a job's TensorBoard scalars (gpipe.coordinator.attempt.board), in its output folder


def prepare_output(spec_name: str, state_dir: Path, fresh: bool) -> Path:
    """<state-dir>/<name>/; a fresh start empties metrics.jsonl and drops an earlier run's checkpoints, best and
    TensorBoard scalars."""
    out = state_dir / spec_name
    try:
        out.mkdir(parents=True, exist_ok=True)
        if fresh:
            (out / "metrics.jsonl").write_text("")
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            shutil.rmtree(out / "best", ignore_errors=True)
            shutil.rmtree(out / TENSORBOARD, ignore_errors=True)
        else:
            (out / "metrics.jsonl").touch()
    except OSError as e:
        raise SpecError(f"--state-dir: cannot write {out}: {e.strerror}") from None
    return out


def private_folder() -> Path:
    """This user's folder of the machine's temporary directory, `run`'s own (its lock files, a spec overridden
    on the command line, which its attempts read): created 0700 if absent, else taken only if it is a real
    folder (no link) that this user owns and nobody else may enter; SpecError otherwise, naming it. Another
    local user could otherwise create it first and swap what the attempts run."""
    d = Path(tempfile.gettempdir()) / f"gpipe-run-{os.getuid()}"
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise SpecError(f"cannot create run's private folder {d}: {e.strerror}") from None
    try:
        st = os.lstat(d)
    except OSError as e:
        raise SpecError(f"run's private folder {d}: {e.strerror}") from None
    why = ("is a link, not a folder" if stat.S_ISLNK(st.st_mode) else
           "is not a folder" if not stat.S_ISDIR(st.st_mode) else
           f"belongs to uid {st.st_uid}, not to this user ({os.getuid()})" if st.st_uid != os.getuid() else
           f"has mode {stat.S_IMODE(st.st_mode):04o}: others may enter it" if st.st_mode & 0o077 else "")
    if why:
        raise SpecError(f"run's private folder {d} {why}: remove it, or set TMPDIR to a folder of your own")
    return d


def _run_file(state_dir: Path, spec_name: str, suffix: str) -> Path:
    """`run`'s own file for job `spec_name` of `state_dir`, outside it (nothing is written there before the
    job's plan holds): in this user's private folder (private_folder), named by a hash of both."""
    key = hashlib.sha256(str(state_dir.resolve() / spec_name).encode()).hexdigest()[:24]
    return private_folder() / f"{spec_name}-{key}{suffix}"


def _lock(path: Path) -> int | None:
    """An fd holding `path` locked (flock, exclusive), or None if another process holds it. Never through a
    link; and the lock counts only while `path` still names the file locked: a holder removes it as it lets go
    (_job_lock), so a lock taken on a file just removed is let go and taken again on the new one."""
    for _ in range(100):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            same = os.path.samestat(os.fstat(fd), os.lstat(path))
        except BlockingIOError:
            os.close(fd)
            return None
        except FileNotFoundError:
            same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)  # removed (or replaced) by its last holder between our open and our lock: again
    raise OSError(errno.EAGAIN, f"{path} kept changing while it was being locked")


@contextlib.contextmanager
def _job_lock(spec_name: str, state_dir: Path, busy: str, cannot: str) -> Iterator[None]:
    """Held: `run`'s lock on job `spec_name` of `state_dir` (SpecError `busy` when another process holds it,
    `cannot` and the reason when it cannot be taken); its file is removed while still held, so nothing is left
    in the temporary directory."""
    path = _run_file(state_dir, spec_name, ".lock")
    try:
        fd = _lock(path)
    except OSError as e:
        raise SpecError(f"{cannot}: {e.strerror}") from None
    if fd is None:
        raise SpecError(busy)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


@contextlib.contextmanager
def running(spec_name: str, state_dir: Path) -> Iterator[None]:
    """`run` trains job `spec_name` in `state_dir`: held while it does, so that `delete` refuses, and a second
    `run` of that name there is one line (exit 2) instead of two runs writing one folder."""
    with _job_lock(spec_name, state_dir, f"job {spec_name!r} is running already in {state_dir} (another run "
                   "holds it)", f"cannot lock job {spec_name!r}"):
        yield


@contextlib.contextmanager
def recorded_spec(spec_name: str, state_dir: Path, text: str) -> Iterator[Path]:
    """A file holding `text`, the job's spec as overridden on the command line, for its attempts to read while
    `run` trains it (plan.json's `spec` keeps it in the job's folder); removed after."""
    folder = private_folder()
    try:
        fd, name = tempfile.mkstemp(suffix=".yaml", prefix=f"{spec_name}-", dir=folder)
        path = Path(name)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError as e:
        raise SpecError(f"cannot write the job's spec in {folder}: {e.strerror}") from None
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def delete_run_output(spec_name: str, state_dir: Path) -> Path:
    """Delete `run`'s job `spec_name`: its folder under `state_dir`. SpecError if there is no such job or a `run`
    is training it."""
    out = state_dir / spec_name
    if not (out / "metrics.jsonl").is_file() and not (out / "plan.json").is_file():
        raise SpecError(f"no job named {spec_name!r} in {state_dir}")
    with _job_lock(spec_name, state_dir, f"job {spec_name!r} is running (a run holds it): stop it first",
                   f"cannot delete {out}"):
        try:
            delete_output(out)
        except OSError as e:
            raise SpecError(f"cannot delete {out}: {e.strerror}") from None
    return out


def delete_output(out: Path) -> None:
    """Remove a job's folder: its record (job.json) first, so that a folder left half deleted is no job."""
    (out / "job.json").unlink(missing_ok=True)
    shutil.rmtree(out)
