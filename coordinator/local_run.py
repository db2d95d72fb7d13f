"""`gpipe-coordinator run job.yaml`: the whole job on this machine, nothing else to start.

Each attempt is a child process (gpipe.coordinator.attempt --local) that plans the
job (every check that needs the model runs before a worker starts), starts one
worker process per stage on loopback, and drives them. When an attempt fails
(a stage raises, a worker dies, a wait times out) and `max_restarts` allows,
a fresh attempt resumes from the last good checkpoint, so the job loses at
most the steps since then and ends with the same weights. Outputs go to
<state-dir>/<name>/: plan.json, metrics.jsonl, checkpoints/, logs/ and, at
the end, model.safetensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpipe.coordinator.progress import Progress
from gpipe.coordinator.spec import JobSpec
from gpipe.errors import EXIT_BAD_INPUT, JobFailed, SpecError
from gpipe.proc import child_env

HOST = "127.0.0.1"  # local workers talk over loopback only


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Failed(Exception):
    def __init__(self, message: str, stage: int | None, exit_code: int):
        super().__init__(message)
        self.message, self.stage, self.exit_code = message, stage, exit_code


def _attempt(spec: JobSpec, spec_path: Path, job_dir: Path, state_dir: Path, resume: bool, number: int,
             bar: Progress) -> None:
    """Run one attempt in a child process, following its reports; raise _Failed if it fails."""
    cmd = [sys.executable, "-m", "gpipe.coordinator.attempt", "--spec", str(spec_path), "--job-dir", str(job_dir),
           "--state-dir", str(state_dir), "--host", HOST, "--local",
           "--attempt", str(number), *(["--resume"] if resume else [])]
    env = child_env(dict(os.environ))
    log_path = state_dir / spec.name / "logs" / "coordinator.log"
    cmd += ["--log", str(log_path)]  # the attempt's own output (RPC warnings, a traceback)
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                             start_new_session=True, env=env)
    error: tuple[str, int | None] | None = None
    done = False
    try:
        assert child.stdout is not None
        for raw in child.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                print(raw, end="", flush=True)  # the model's own output
                continue
            if "metrics" in msg:
                m = msg["metrics"]
                bar.update(m["step"], m["loss"], m["samples_per_s"])
            elif "resumed" in msg:
                bar.restart(msg["resumed"])
            elif "log" in msg:
                bar.write(f"{spec.name}: {msg['log']}")
            elif "checkpoint" in msg:
                c = msg["checkpoint"]
                bar.checkpoint(c["step"], c["bytes"], c["write_s"])
            elif "error" in msg:
                error = (msg["error"], msg.get("stage"))
            elif msg.get("done"):
                done = True
        code = child.wait()
    finally:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    if done and code == 0:
        return
    if error is None:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        error = (f"the coordinator's attempt process died ({how}); its log: {log_path}", None)
    raise _Failed(error[0], error[1], code)


def _attempts_logged(out: Path) -> int:
    """The highest attempt number in the job's metrics.jsonl, so a resumed run numbers its own after it."""
    n = 0
    try:
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                n = max(n, int(json.loads(line).get("attempt", 1)))
    except OSError:
        pass
    return n


def run_local(spec: JobSpec, spec_path: Path, state_dir: Path, progress: bool = True,
              resume: bool = False) -> Path:
    """Train `spec` with local workers, restarting from checkpoints; return the job's output directory."""
    out = state_dir / spec.name  # the first attempt prepares it, once the plan holds
    before = _attempts_logged(out) if resume else 0
    bar = Progress(spec.steps, enabled=progress)
    first: _Failed | None = None
    restarts = 0
    t0 = time.monotonic()
    try:
        while True:
            try:
                _attempt(spec, spec_path.resolve(), spec_path.resolve().parent, state_dir.resolve(),
                         resume or restarts > 0, before + restarts + 1, bar)
                break
            except _Failed as e:
                if e.exit_code == EXIT_BAD_INPUT:
                    raise SpecError(e.message) from None
                first = first or e
                if restarts >= spec.max_restarts:
                    if restarts == 0:
                        raise JobFailed(e.message, e.stage) from None
                    raise JobFailed(f"{first.message} (the first failure; gave up after {restarts} restart(s); "
                                    f"the last failure: {e.message})", first.stage) from None
                restarts += 1
                bar.write(f"{spec.name}: {e.message}")
                bar.write(f"{spec.name}: RESTARTING ({restarts} of {spec.max_restarts}) from the last good checkpoint")
    finally:
        bar.close()
    again = f" after {restarts} restart(s)" if restarts else ""
    _say(f"{spec.name}: done in {time.monotonic() - t0:.1f}s{again}; weights in {out / 'model.safetensors'}")
    return out
