"""One attempt of a service job, in a child process of `gpipe-coordinator serve`.

Each attempt gets a fresh process, so a fresh RPC world: one that saw a failure
is never reused. It plans the job, opens the rendezvous on --host, and tells
its parent, one JSON object a line on stdout:

    {"master": "HOST:PORT"}           the workers may join now
    {"metrics": {...}}                a logged step (also in metrics.jsonl)
    {"error": "...", "stage": K}      the attempt failed (stage null if none is to blame)
    {"done": true}                    trained; model.safetensors is written

    python -m coordinator.remote_attempt --spec S --state-dir D --host H --devices cpu,cpu
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from coordinator.driver import MetricsLog, StepMetrics, drive, prepare_output, write_plan
from coordinator.plan import make_plan
from coordinator.spec import load_spec
from gpipe import net, proc
from gpipe.errors import GpipeError


def tell(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coordinator.remote_attempt")
    p.add_argument("--spec", required=True)
    p.add_argument("--state-dir", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--devices", required=True, help="each stage's device, comma-separated")
    a = p.parse_args(argv)
    proc.adopt()
    warnings.filterwarnings("ignore", message="You are using a Backend")
    try:
        spec = load_spec(a.spec)
        devices = a.devices.split(",")
        plan = make_plan(spec, Path(a.spec).resolve().parent, devices[0])
        out = prepare_output(spec.name, Path(a.state_dir))
        write_plan(out, plan, [{"device": d} for d in devices])
        torch.set_num_threads(1)
        net.bind_to(a.host)
        _, port = net.bound_store(a.host, spec.start_timeout_s)
        tell({"master": f"{a.host}:{port}"})
        log = MetricsLog(out, spec.log_every, spec.steps)

        def on_step(m: StepMetrics) -> None:
            if log.write(m):
                tell({"metrics": asdict(m)})

        try:
            drive(plan, out, a.host, port, devices, lambda: None, on_step)
        finally:
            log.close()
    except GpipeError as e:
        tell({"error": str(e), "stage": getattr(e, "stage", None)})
        return e.exit_code
    except Exception as e:
        tell({"error": f"internal error: {type(e).__name__}: {e}", "stage": None})
        return 1
    tell({"done": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
