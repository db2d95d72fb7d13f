"""What a pipelined action costs beyond its compute: the service's F and B against the same blocks alone.

    python bench/action_cost.py [--rounds 3] [--steps 30] [--width 1024]

The model and micro-batches are bench/step_time.py's: 8 x (Linear(1024)+ReLU),
batch 256 in 8 micro-batches of 32, one thread per process. Interleaved round
by round, medians over rounds:

- alone: the same 4 blocks in a plain training loop (LOOP), in a process
  pinned to one core, doing a stage's work without the engine: the batch's
  micro-batches in turn in 1f1b's order, each stage's linears fused as a
  worker's are (gpipe.grad_in_place.fuse), the loss where the stage has it,
  and the optimizer's step after each batch; for each role a stage plays
  (the only stage; stage 0 of 2, whose input wants no gradient; stage 1 of
  2, whose input does, with the loss), and again beside stage 1's loop on
  the other core, as a 2-stage pipeline's stages compute side by side (they
  share the last-level cache and the memory bandwidth: the 2-stage service's
  actions are held against this one);
- 1 stage: `gpipe-coordinator run` of those 4 blocks on one stage, so no data
  plane: F and B from metrics.jsonl's timeline;
- 2 stages: the 8 blocks on 2 stages, 1f1b: each stage's F and B.

"over" is an action's cost beyond its blocks: per round, the service's median
less its loop's, then the median over rounds. At `--width 16` the blocks
compute next to nothing, so what is left is the engine's own cost of an
action, measured to a few microseconds on this noisy machine; at 1024 the
noise of a round is some 0.5 ms, so it takes rounds.

- 2 stages, from inside: the 2-stage run again, with a probe in each worker
  (PROBE) timing each action's blocks (F: each layer's call and the loss; B:
  autograd's backward) and its send. The action less its blocks, in the
  same process, is the engine's own cost with none of the drift between two
  processes' compute (at width 1024 a process's blocks run some 0.3-0.8 ms
  faster or slower than another's, round to round).

The 2-stage run also gives each process's CPU per step, read from
/proc/PID/stat over the run's middle: the two workers, the coordinator's
attempt, and `run` itself. On this machine's 2 cores, the attempt shares a core
with a worker.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import BATCH, CHUNKS, WIDTH, cores, env  # noqa: E402

BLOCKS = 4  # per stage

# The same blocks in a plain training loop, as a stage runs them: the batch's micro-batches in turn, fused
# (gpipe.grad_in_place.fuse, as a worker's stage runs its linears), 1f1b's order and micro-batches in flight
# for the role, the optimizer's step and zero_grad after each batch. Roles: "first" (stage 0 of 2: no input
# gradient, its output's gradient given as stage 1 sends it), "last" (stage 1 of 2: its input wants a gradient,
# then the loss) and "only" (1 stage: the loss, no input gradient). argv: role, width, steps (0: until killed).
LOOP = f"""
import collections, statistics, sys, time, torch
from gpipe import grad_in_place
torch.set_num_threads(1)
role, width, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
batch, chunks = {BATCH}, {CHUNKS}
size = batch // chunks
torch.manual_seed(0)
layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                               for _ in range({BLOCKS})])
grad_in_place.fuse(layers)
opt = torch.optim.SGD(layers.parameters(), lr=1e-3)
x, target = torch.randn(batch, width), torch.randn(batch, width)
in_flight = 2 if role == "first" else 1  # 1f1b: stage k of P holds P - k micro-batches
f, b, step = [], [], 0
while steps == 0 or step < steps:
    held = collections.deque()
    def forward(i):
        xi = x[i * size:(i + 1) * size].clone().requires_grad_(role == "last")  # as it arrives: a new tensor
        t0 = time.perf_counter()
        y = layers(xi)
        if role != "first":
            y = torch.nn.functional.mse_loss(y, target[i * size:(i + 1) * size])
        f.append(time.perf_counter() - t0)
        held.append(y)
    def backward():
        y = held.popleft()
        g = torch.ones_like(y) if role == "first" else None  # stage 1's gradient arrives as a new tensor
        t0 = time.perf_counter()
        if g is None:
            y = y * (size / batch)  # the loss's weight: a micro-batch's share of the batch
        y.backward(g)
        b.append(time.perf_counter() - t0)
    for i in range(chunks):
        forward(i)
        if len(held) == in_flight:
            backward()
    while held:
        backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    step += 1
    if step == 5:
        f.clear(), b.clear()  # past the first steps
print(statistics.median(f), statistics.median(b))
"""
ROLES = ("only", "first", "last")

# A probe in each worker of the 2-stage run (a sitecustomize.py on its PYTHONPATH, GPIPE_BENCH_PROBE naming where it
# writes): per action, the time inside its blocks (F: each layer's call and the loss; B: autograd's backward) and
# inside its send, in the same process as the action, so that what is left is the engine's own cost with none of
# two processes' drift between them. Written at each step's end: (stage, kind, action s, blocks s, send s) per
# action, in the timeline's order. Its own clock reads (two per layer, loss, backward and send) cost some 1-2 us an
# action, most of it counted inside the blocks.
PROBE = """
import json, os, time
OUT = os.environ.get("GPIPE_BENCH_PROBE")
if OUT:
    import torch
    import gpipe.stage as st
    from gpipe.worker import unix_lane
    clock = time.perf_counter
    now = {"blocks": 0.0, "send": 0.0}
    def timed(f, what):
        def call(*a, **k):
            t = clock()
            try:
                return f(*a, **k)
            finally:
                now[what] += clock() - t
        return call
    torch.autograd.backward = timed(torch.autograd.backward, "blocks")
    torch.autograd.grad = timed(torch.autograd.grad, "blocks")  # a split backward's B (its W: backward)
    unix_lane.UnixSender.send = timed(unix_lane.UnixSender.send, "send")
    def action(f):  # (a worker's actions run one at a time, on one thread: gpipe.turns)
        def run(self, mb, p):
            now["blocks"] = now["send"] = 0.0
            f(self, mb, p)
            self._probe_got.append((now["blocks"], now["send"]))
        return run
    st.Stage.ACTIONS = {k: action(f) for k, f in st.Stage.ACTIONS.items()}
    run = st.Stage.run
    def timed_run(self, actions, positions, p, t_start):
        if not getattr(self, "_probed", False):
            if self.shared_rng is not None:
                raise RuntimeError("the probe times stages in processes of their own, not gpipe.Pipeline's threads")
            self._probed = True
            self.indexed = [(n, timed(m, "blocks")) for n, m in self.indexed]
            if self.loss_fn is not None:
                self.loss_fn = timed(self.loss_fn, "blocks")
        self._probe_got = []
        run(self, actions, positions, p, t_start)
        rows = [(self.cfg.model_chunk, kind, end - start, b, s)
                for (kind, _, start, end), (b, s) in zip(p.timeline, self._probe_got, strict=True)]
        with open(os.path.join(OUT, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(rows) + "\\n")
    st.Stage.run = timed_run
"""


def alone(width: int, steps: int, beside: bool = False) -> dict[str, float]:
    """F and B of a micro-batch through the blocks in a plain training loop (LOOP), for each role, on the last
    core. `beside`: with stage 1's loop running on the first core meanwhile, as a 2-stage pipeline's other
    worker computes beside each stage (the two share the last-level cache and the memory bandwidth)."""
    other = None
    if beside and len(cores()) > 1:
        other = subprocess.Popen(["taskset", "-c", str(cores()[0]), sys.executable, "-c", LOOP, "last",
                                  str(width), "0"], env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # past its imports
    out: dict[str, float] = {}
    try:
        for role in ROLES:
            got = subprocess.run(["taskset", "-c", str(cores()[-1]), sys.executable, "-c", LOOP, role, str(width),
                                  str(steps + 5)], env=env(), capture_output=True, text=True, check=True,
                                 timeout=300).stdout.split()
            out[f"{role} F"], out[f"{role} B"] = map(float, got)
    finally:
        if other is not None:
            other.kill()
            other.wait()
    return out


def _cpu(pid: int) -> tuple[str, float] | None:
    """(name, CPU seconds) of a process, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    return name, (int(rest[11]) + int(rest[12])) / 100  # utime + stime, in clock ticks of 1/100 s


def _tree(root: int) -> list[int]:
    """`root` and every process under it."""
    parents: dict[int, list[int]] = {}
    for p in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int(p.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += parents.get(pid, [])
    return out


def service(stages: int, steps: int, tmp: Path, width: int = WIDTH,
            checkout: Path | None = None, probe: bool = False, probe_code: str = PROBE) -> dict[str, Any]:
    """Median F and B per stage from a `run` of `stages` stages; with 2, also CPU per step by process. With
    `checkout`, that checkout's gpipe (set up: make setup), from its own environment. `probe`: each action's time
    in its blocks and its send, from inside the workers (PROBE): out["probe"][stage kind] = (the action less its
    blocks, its send), medians. `probe_code`: another probe, written as PROBE writes its rows (a JSON list a line,
    a line a step); out["probe_rows"] then holds its rows past each worker's first 3 steps, as they are."""
    name = f"cost-{stages}"
    spec = {
        "name": name, "model": {"factory": "mlp", "args": {"width": width, "depth": BLOCKS * stages, "head": False}},
        "stages": stages, "chunks": CHUNKS, "schedule": "1f1b", "balance": [BLOCKS] * stages,
        "data": {"factory": "random_regression", "args": {"n": BATCH, "in_features": width, "out_features": width},
                 "batch_size": BATCH},
        "loss": "mse", "optimizer": {"name": "sgd", "lr": 1e-3}, "steps": steps + 3,
    }
    job = tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump(spec))
    e, cmd = env(), [sys.executable, "-m", "gpipe.coordinator.cli.main"]
    if checkout is not None:
        e.pop("PYTHONPATH", None)  # it imports its own gpipe
        cmd = [str(checkout / ".venv/bin/gpipe-coordinator")]
    probed = tmp / f"{name}-probe"
    if probe:
        shutil.rmtree(probed, ignore_errors=True)
        (probed / "out").mkdir(parents=True)
        (probed / "sitecustomize.py").write_text(probe_code)
        e["PYTHONPATH"] = ":".join(x for x in (str(probed), e.get("PYTHONPATH")) if x)
        e["GPIPE_BENCH_PROBE"] = str(probed / "out")
    p = subprocess.Popen([*cmd, "run", str(job), "--state-dir", str(tmp), "--no-progress"], env=e,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=checkout)
    metrics = tmp / name / "metrics.jsonl"
    cpu: list[tuple[str, float]] = []  # (process name, CPU seconds per step), each process
    window = 0.0
    if stages == 2:  # sample the processes from the 4th step over half the steps
        deadline = time.monotonic() + 300
        while (not metrics.exists() or len(metrics.read_text().splitlines()) < 4) and p.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the 2-stage run made no 4 steps in 300 s")
            time.sleep(0.05)
        pids = _tree(p.pid)
        before = {pid: _cpu(pid) for pid in pids}
        t0, n0 = time.monotonic(), len(metrics.read_text().splitlines())
        while len(metrics.read_text().splitlines()) < n0 + steps // 2 and p.poll() is None:
            time.sleep(0.01)
        after = {pid: _cpu(pid) for pid in pids}
        window = time.monotonic() - t0
        done = len(metrics.read_text().splitlines()) - n0
        for pid in pids:
            a, b = before[pid], after[pid]
            if a is not None and b is not None and b[1] > a[1]:
                cpu.append((b[0], (b[1] - a[1]) / max(done, 1)))
    _, err = p.communicate(timeout=600)
    if p.returncode:
        raise RuntimeError(f"run failed: {err[-2000:]}")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()[3:]]
    out: dict[str, Any] = {"step": statistics.median(r["step_time_s"] for r in rows), "cpu": cpu, "window": window}
    if probe:  # past each worker's first 3 steps, as the timeline's figures below
        acts = [a for f in (probed / "out").glob("*.jsonl") for line in f.read_text().splitlines()[3:]
                for a in json.loads(line)]
        if not acts:
            raise RuntimeError(f"the probe wrote nothing: its sitecustomize did not load in the workers (their "
                               f"logs, kept: {tmp / name})")
        shutil.rmtree(probed)
        if probe_code is not PROBE:
            out["probe_rows"] = acts
        else:
            out["probe"] = {
                f"stage {k} {kind}": (statistics.median(a - b for s, x, a, b, _ in acts if (s, x) == (k, kind)),
                                      statistics.median(c for s, x, _, _, c in acts if (s, x) == (k, kind)))
                for k in range(stages) for kind in ("F", "B")}
    shutil.rmtree(tmp / name)  # the next round's run starts afresh
    for k in range(stages):
        for kind in ("F", "B"):
            out[f"stage {k} {kind}"] = statistics.median(
                b - a for r in rows for s in r["stages"] if s["stage"] == k for act, _, a, b in s["timeline"]
                if act == kind)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=WIDTH, help="the blocks' width (16: the engine's own cost, with "
                    "next to no compute)")
    ap.add_argument("--before", type=Path, help="another checkout, set up (make setup): its service runs too, "
                    "interleaved, for its rows beside ours in one run")
    a = ap.parse_args()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            got = {"alone": alone(a.width, a.steps), "beside": alone(a.width, a.steps, beside=True),
                   "1 stage": service(1, a.steps, Path(d), a.width), "2 stages": service(2, a.steps, Path(d), a.width),
                   "probed": service(2, a.steps, Path(d), a.width, probe=True)}
            if a.before is not None:
                got["before 1 stage"] = service(1, a.steps, Path(d), a.width, a.before)
                got["before 2 stages"] = service(2, a.steps, Path(d), a.width, a.before)
                got["before probed"] = service(2, a.steps, Path(d), a.width, a.before, probe=True)
            rounds.append(got)
            print(f"round {r + 1}: 2-stage step {got['2 stages']['step'] * 1e3:.1f} ms", file=sys.stderr, flush=True)

    def med(who: str, key: str) -> float:
        return float(statistics.median(r[who][key] for r in rounds)) * 1e3

    def over(who: str, key: str, base: str, base_key: str) -> float:
        """The median over rounds of the service's figure less the loop's of the same round."""
        return float(statistics.median(r[who][key] - r[base][base_key] for r in rounds)) * 1e3

    print(f"\nF and B of one micro-batch ({BATCH // CHUNKS} x {a.width}) through {BLOCKS} x "
          f"(Linear({a.width})+ReLU), ms, medians of {a.rounds} rounds; \"over\": the median over rounds of the "
          "service's less the loop's of the same round")
    print(f"{'where':64} {'F':>7} {'B':>7} {'F over':>7} {'B over':>7}")
    rows = [("the blocks in a training loop, 1 stage's role", "alone", "only", None),
            ("the blocks beside a loop on the other core, stage 0's role", "beside", "first", None),
            ("the blocks beside a loop on the other core, stage 1's role", "beside", "last", None)]
    for pre in ("", "before ") if a.before is not None else ("",):
        rows += [(f"{pre}service, 1 stage (no data plane)", f"{pre}1 stage", "stage 0", ("alone", "only")),
                 (f"{pre}service, 2 stages: stage 0", f"{pre}2 stages", "stage 0", ("beside", "first")),
                 (f"{pre}service, 2 stages: stage 1", f"{pre}2 stages", "stage 1", ("beside", "last"))]
    for where, who, key, base in rows:
        line = f"{where:64} {med(who, key + ' F'):7.3f} {med(who, key + ' B'):7.3f}"
        if base is not None:
            line += f" {over(who, key + ' F', base[0], base[1] + ' F'):+7.3f} " \
                    f"{over(who, key + ' B', base[0], base[1] + ' B'):+7.3f}"
        print(line)
    print("\nThe same actions from inside the 2-stage run's workers (a probe, its own run): each action less the "
          "time in its blocks, in the same process; of it, its send (ms, medians of rounds)")
    print(f"{'where':64} {'F':>7} {'send':>7} {'B':>7} {'send':>7}")
    for pre in ("", "before ") if a.before is not None else ("",):
        for k in range(2):
            fig = [float(statistics.median(r[pre + "probed"]["probe"][f"stage {k} {kind}"][i] for r in rounds)) * 1e3
                   for kind in ("F", "B") for i in (0, 1)]
            print(f"{f'{pre}service, 2 stages: stage {k}, beyond its blocks':64} " +
                  " ".join(f"{v:+7.3f}" for v in fig))
    for pre in ("", "before ") if a.before is not None else ("",):
        print(f"{pre}2 stages, 1f1b: step {med(pre + '2 stages', 'step'):.1f} ms")
    print(f"2 stages: CPU per step by process (ms; the last round, {rounds[-1]['2 stages']['window']:.1f} s of it):")
    for name, sec in sorted(rounds[-1]["2 stages"]["cpu"], key=lambda kv: -kv[1]):
        print(f"  {name:20} {sec * 1e3:7.2f}")


if __name__ == "__main__":
    main()
