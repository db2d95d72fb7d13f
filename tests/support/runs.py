"""What the end-to-end tests read of a run: its metrics lines, its stderr as it comes, its weights against one
device's; and a run whose worker is killed mid-way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import torch
from safetensors.torch import load_file

from gpipe.factory import resolve
from tests.support import reference
from tests.support.cli import tagged_pids, wait_for


def check_steady(schedule: dict[str, Any], spec: dict[str, Any]) -> None:
    """plan.json's bubble of steps in a row: one step's alone where each step ends waiting for every stage
    (clipping, fp16), else between 0 and that."""
    steady, alone = schedule["steady_bubble_fraction"], schedule["simulated_bubble_fraction"]
    if spec.get("clip_grad_norm") or spec.get("precision") == "fp16":
        assert steady == alone, schedule
    else:
        assert 0 <= steady <= alone, schedule


def check_timeline(out, stages: int, chunks: int, step: int, more: str = "") -> None:
    """trace.json holds each stage's forwards and backwards of step number `step` (counted from 1, as the
    progress bar counts), and the actions of kinds `more` (W); timeline.svg draws a bar for each of them."""
    trace = json.loads((out / "trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert trace["traceEvents"][0]["args"]["name"] == f"step {step}"
    for k in range(stages):
        names = sorted(e["name"] for e in slices if e["tid"] == k)
        assert names == sorted(f"{kind}{i}" for kind in "FB" + more for i in range(chunks))
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in slices)
    svg = ElementTree.parse(out / "timeline.svg").getroot()
    bars = [r.find("{http://www.w3.org/2000/svg}title") for r in svg.iter("{http://www.w3.org/2000/svg}rect")]
    assert sorted(t.text.split(":")[0] for t in bars if t is not None) == sorted(e["name"] for e in slices)


def train_and_compare(cli, name: str, spec: dict) -> list[dict]:
    """Run `spec` pipelined; its weights equal one device's to 1e-5. Returns the metrics' lines."""
    path = cli.write(spec)
    r = cli.run("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress")
    assert r.returncode == 0, r.stderr
    out = cli.tmp / "state" / "t"
    got = load_file(out / "model.safetensors")

    want = reference.train(spec)
    assert set(got) == set(want)
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"{name}: largest weight difference {worst:.3g}")
    assert worst <= 1e-5, f"{name}: weights differ from one device by {worst}"

    # The weights load into the un-partitioned model.
    torch.manual_seed(0)
    resolve(spec["model"]["factory"])(**spec["model"]["args"]).load_state_dict(got)

    split = "W" if spec.get("schedule") == "zb-h1" else ""
    check_timeline(out, spec["stages"], spec["chunks"], spec["steps"], split)
    plan = json.loads((out / "plan.json").read_text())["schedule"]
    assert plan["name"] == spec.get("schedule", "gpipe") and len(plan["actions"]) == spec["stages"]
    check_steady(plan, spec)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(spec["steps"]))
    for m in lines:
        assert m["loss"] > 0 and m["step_time_s"] > 0 and m["samples_per_s"] > 0
        assert 0 <= m["bubble_fraction"] < 1
        assert [s["stage"] for s in m["stages"]] == list(range(spec["stages"]))
        assert all(s["busy_s"] > 0 and s["peak_memory_bytes"] > 0 for s in m["stages"])
        assert all(s["rss_bytes"] > 0 for s in m["stages"])  # the process's resident memory at the step's end
    return lines



class Lines:
    """A process's stderr, read as it comes, each line with the time it arrived."""

    def __init__(self, p: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self._t = threading.Thread(target=self._read, args=(p,), daemon=True)
        self._t.start()

    def _read(self, p: subprocess.Popen) -> None:
        for line in p.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def when(self, text: str) -> float | None:
        return next((t for t, x in self.lines if text in x), None)

    def text(self) -> str:
        self._t.join(timeout=10)
        return "\n".join(x for _, x in self.lines)


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]



def kill_mid_run(cli, spec: dict, log: str) -> str:
    """`run` spec; after step 3, SIGKILL the worker whose log is `log`; the run's stderr once it succeeded."""


    out = cli.tmp / "state" / spec["name"]
    with cli.running("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress") as p:
        lines = Lines(p)
        wait_for(lambda: len(metrics(out)) > 3, 90, "step 3")
        pid = next((pid for pid in tagged_pids(cli.tag) if _log_of(pid).endswith(f"/{log}")), None)
        assert pid, f"no worker process found writing {log}"
        os.kill(pid, signal.SIGKILL)
        p.wait(timeout=120)
        err = lines.text()
    assert p.returncode == 0, err
    return err


def _log_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return ""



def lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def one_device_eval(spec: dict, steps: int) -> tuple[float, int]:
    return reference.evaluate(spec, reference.train({**spec, "steps": steps}))


def assert_one_device(spec: dict, evals: list[dict], tol: float = 1e-5) -> None:
    for m in evals:
        want, samples = one_device_eval(spec, m["step"] + 1)
        assert m["eval_samples"] == samples
        assert abs(m["eval_loss"] - want) < tol, (m["step"], m["eval_loss"], want)

