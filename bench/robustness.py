"""serve under load and SIGTERM: how long other callers wait, how soon processes end.

    python bench/robustness.py --rounds 3 [--port P] [--sigterm-only]

Busy: a 1 MiB spec (a 2-stage MLP whose model args carry a 135k-int list,
parsed by serve off its event loop, then by the validation process) is
submitted while a second thread calls ListJobs every 20 ms and a registered
worker heartbeats every 0.5 s. Reported: the slowest ListJobs and heartbeat
answer during the submission, and the submission's own time.

SIGTERM: serve with two workers and a running job. The time from SIGTERM to
exit of serve with a running attempt, of a worker in a running job (after
serve restarted and the job resumed), of a worker left idle, and of serve with
no attempt. The first two include the job's checkpoint at its next step
boundary (preemption: the job is left PREEMPTED each time).

Each figure is the median of --rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import yaml

from gpipe.service.v1 import jobs_pb2, jobs_pb2_grpc, workers_pb2, workers_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
SLOW = {"factory": "tests.support.models:slow_mlp", "args": {"width": 16, "seconds": 0.02}}


def spec(name: str, **kw: object) -> dict:
    return {
        "name": name, "model": {"factory": "mlp", "args": {"width": 16, "depth": 3}}, "stages": 2,
        "balance": [2, 2], "chunks": 2, "loss": "mse", "optimizer": {"name": "sgd", "lr": 0.05}, "steps": 5,
        "data": {"factory": "random_regression", "args": {"n": 40, "in_features": 16, "out_features": 16},
                 "batch_size": 8},
    } | kw


class Cluster:
    """serve and its workers as processes, in `tmp`."""

    def __init__(self, tmp: Path, port: int = 0):
        self.tmp = tmp
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the last round's serve may linger in TIME_WAIT
            s.bind(("127.0.0.1", port))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, key: str, args: list[str], ready: str) -> None:
        log = self.tmp / f"{key}.log"
        before = self.log(key).count(ready)
        with log.open("ab") as f:
            self.procs[key] = subprocess.Popen([sys.executable, "-m", *args], cwd=self.tmp, env=self.env,
                                               stdout=f, stderr=f, start_new_session=True)
        self.wait(lambda: self.log(key).count(ready) > before, f"{key}: {ready}")

    def serve(self) -> None:
        self.start("serve", ["gpipe.coordinator.cli.main", "serve", "--port", str(self.port), "--state-dir",
                             str(self.tmp / "state")], "coordinator serving on")

    def worker(self, rank: int) -> None:
        self.start(f"worker{rank}", ["gpipe.worker.daemon", "--rank", str(rank), "--coordinator", self.address,
                                     "--cores", str(rank % os.cpu_count()), "--log-dir",
                                     str(self.tmp / f"w{rank}")], "registered as rank")

    def log(self, key: str) -> str:
        p = self.tmp / f"{key}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def wait(self, cond, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}\n" + "".join(self.log(k)[-2000:] for k in self.procs))
            time.sleep(0.02)

    def sigterm(self, key: str) -> float:
        p = self.procs.pop(key)
        t0 = time.perf_counter()
        os.kill(p.pid, signal.SIGTERM)
        code = p.wait(timeout=30)
        took = time.perf_counter() - t0
        if code != 0 or "Traceback" in self.log(key):
            raise SystemExit(f"{key} exited {code} after SIGTERM:\n{self.log(key)[-2000:]}")
        return took

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()

    def steps(self, name: str) -> int:
        path = self.tmp / "state" / name / "metrics.jsonl"
        return path.read_text().count("\n") if path.exists() else 0


def busy_round(c: Cluster, r: int) -> tuple[float, float, float]:
    model = {"factory": "mlp", "args": {"width": 16, "depth": 3, "pad": list(range(135_000))}}
    text = yaml.safe_dump(spec(f"big{r}", model=model), default_flow_style=None, width=1 << 30)
    assert len(text.encode()) <= 1 << 20
    ch = grpc.insecure_channel(c.address)
    jobs, workers = jobs_pb2_grpc.JobServiceStub(ch), workers_pb2_grpc.WorkerServiceStub(ch)
    reg = workers.Register(workers_pb2.RegisterRequest(rank=100 + r, host="127.0.0.1", hostname="bench",
                                                       cores=[0], threads=1), timeout=30)
    slowest = {"list": 0.0, "beat": 0.0}
    done = threading.Event()

    def poll(key: str, call, every: float) -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            call()
            slowest[key] = max(slowest[key], time.perf_counter() - t0)
            time.sleep(every)

    threads = [threading.Thread(target=poll, args=("list", lambda: jobs.ListJobs(jobs_pb2.ListJobsRequest(),
                                                                                  timeout=60), 0.02)),
               threading.Thread(target=poll, args=("beat", lambda: workers.Heartbeat(
                   workers_pb2.HeartbeatRequest(worker_id=reg.worker_id), timeout=60), 0.5))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    try:
        jobs.SubmitJob(jobs_pb2.SubmitJobRequest(spec_yaml=text), timeout=300)
        raise SystemExit("the 1 MiB spec was accepted: its model args should fail validation")
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.INVALID_ARGUMENT or "pad" not in (e.details() or ""):
            raise SystemExit(f"unexpected answer to the 1 MiB spec: {e.code().name}: {e.details()}") from None
    took = time.perf_counter() - t0
    done.set()
    for t in threads:
        t.join()
    ch.close()
    return slowest["list"], slowest["beat"], took


def sigterm_round(c: Cluster, r: int) -> tuple[float, float, float, float]:
    c.serve()
    c.worker(0)
    c.worker(1)
    name = f"term{r}"
    (c.tmp / f"{name}.yaml").write_text(yaml.safe_dump(spec(name, model=SLOW, steps=10_000, checkpoint_every=5)))
    subprocess.run([sys.executable, "-m", "gpipe.coordinator.cli.main", "submit", f"{name}.yaml", "--coordinator",
                    c.address], cwd=c.tmp, env=c.env, check=True, capture_output=True, timeout=300)
    c.wait(lambda: c.steps(name) > 3, "the job's step 3")
    serve_running = c.sigterm("serve")
    assert json.loads((c.tmp / "state" / name / "job.json").read_text())["state"] == "PREEMPTED"
    c.serve()
    before = c.steps(name)
    c.wait(lambda: c.steps(name) > before + 3, "the job to run again")
    worker_running = c.sigterm("worker1")
    c.wait(lambda: "PREEMPTED" in c.log("serve").rsplit(f"job {name} ", 1)[-1], "the job to be PREEMPTED")
    time.sleep(0.5)  # worker0's attempt aborted: it is idle
    worker_idle = c.sigterm("worker0")
    serve_idle = c.sigterm("serve")
    return serve_running, worker_running, worker_idle, serve_idle


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=0, help="serve's port (default: any free one)")
    p.add_argument("--sigterm-only", action="store_true", help="only the SIGTERM rounds")
    a = p.parse_args()
    busy: list[tuple[float, float, float]] = []
    term: list[tuple[float, float, float, float]] = []
    with tempfile.TemporaryDirectory() as d:
        c = Cluster(Path(d), a.port)
        try:
            c.serve()
            for r in range(0 if a.sigterm_only else a.rounds):
                busy.append(busy_round(c, r))
                print(f"busy round {r}: slowest ListJobs {busy[-1][0] * 1e3:.0f} ms, slowest heartbeat "
                      f"{busy[-1][1] * 1e3:.0f} ms, the 1 MiB submission {busy[-1][2]:.1f} s", flush=True)
            c.sigterm("serve")
        finally:
            c.stop()
        for r in range(a.rounds):  # each on its own state dir: no job left from the last round
            (Path(d) / f"term{r}").mkdir()
            c = Cluster(Path(d) / f"term{r}", a.port)
            try:
                term.append(sigterm_round(c, r))
            finally:
                c.stop()
            print(f"SIGTERM round {r}: " + ", ".join(f"{x:.3f} s" for x in term[-1]), flush=True)
    if busy:
        med = [statistics.median(x[i] for x in busy) for i in range(3)]
        print(f"\nmedian of {a.rounds}, while a 1 MiB spec is parsed and validated ({med[2]:.1f} s): the slowest "
              f"ListJobs answer {med[0] * 1e3:.0f} ms, the slowest heartbeat answer {med[1] * 1e3:.0f} ms")
    med = [statistics.median(x[i] for x in term) for i in range(4)]
    print(f"median of {a.rounds}, SIGTERM to exit: serve with a running attempt {med[0]:.3f} s, a worker in a "
          f"running job {med[1]:.3f} s, an idle worker {med[2]:.3f} s, serve with no attempt {med[3]:.3f} s")


if __name__ == "__main__":
    main()
