"""The runtime's own memory: what a worker's process holds before any weight or activation of its job.

A worker's peak on the CPU is its process's resident peak, which starts at
this: Python, torch and gpipe's modules (gpipe.worker.agent.WORKER_PRELOAD), and what
the job's model brings before it holds any weight: the modules its factory
imports (transformers: some 50 MiB) and, for a model that is not an
nn.Sequential, its captured pieces (gpipe.capture.graph: the graphs), which a
worker loads from the plan's capture (gpipe.capture.skeleton.pack). So it is
measured as a worker would get there: a fresh Python, with the worker's malloc
settings, imports those modules, builds the model on the meta device
(gpipe.capture.skeleton), loads the plan's pieces (all of them: a worker holds
its own stage's), and reports its peak resident memory (VmHWM). Building on the meta device takes no weights;
where it fails, the figure is that of the imports alone.

It costs a few seconds (an import of torch, and of the model's own modules), so
it is kept in the user's cache ($XDG_CACHE_HOME/gpipe, else ~/.cache/gpipe),
keyed by the host, the Python, torch and gpipe, and the model (its factory; its
arguments and cut too when it is captured, whose graphs grow with it). A cache
that cannot be written only costs the next plan the same seconds. On CUDA the
allocator's peak counts tensors only: the baseline there is 0.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpipe.capture import skeleton
from gpipe.coordinator.plan.job import Plan
from gpipe.files import atomic_write_json

TIMEOUT_S = 180.0  # importing torch and the model's modules, and loading its pieces, on a loaded machine

# The measuring process: stdin is the request (the worker's modules, the model's factory and its capture).
_CHILD = """
import importlib, json, sys
from gpipe.proc import adopt
adopt()  # dies with the plan's process
req = json.loads(sys.stdin.read())
for m in req["preload"]:
    importlib.import_module(m)
try:
    from gpipe.capture import skeleton
    from gpipe.factory import add_import_paths, resolve
    add_import_paths(req["import_paths"])
    build = resolve(req["factory"])
    model, _ = skeleton.skeleton(lambda: build(**req["args"]))
    if req["pieces"]:
        import base64
        skeleton.unpack(base64.b64decode(req["pieces"]))
except Exception as e:
    print(f"the model on the meta device: {type(e).__name__}: {e}", file=sys.stderr)
from gpipe.memory.meter import resident_peak_bytes
print(resident_peak_bytes())
"""


def cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "gpipe" / "baseline.json"


def _request(plan: Plan) -> dict[str, Any]:
    from gpipe.worker.agent import WORKER_PRELOAD

    m = plan.spec.model
    return {"preload": list(WORKER_PRELOAD), "import_paths": plan.import_paths, "factory": m.factory,
            "args": m.args, "capture": plan.capture_args(), "pieces": ""}


def _with_pieces(req: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """`req` with the plan's captured pieces, as a worker loads them (all of them); as it is where they do not
    pickle (the stages then capture the model themselves)."""
    if plan.captured is None:
        return req
    try:
        return {**req, "pieces": base64.b64encode(skeleton.pack(plan.model, 0, len(plan.model))).decode()}
    except Exception:
        return req


@functools.cache
def _software() -> list[str]:
    """The host and the software a baseline holds for: its name, the Python, torch and gpipe."""
    import torch

    try:
        from importlib.metadata import version

        ours = version("gpipe")
    except Exception:
        ours = "?"
    return [platform.node(), sys.prefix, platform.python_version(), torch.__version__, ours,
            str(Path(__file__).resolve().parents[2])]  # the checkout or site-packages gpipe runs from


def _key(req: dict[str, Any]) -> str:
    # An nn.Sequential's arguments change its weights, not what the process imports.
    # (the pieces: what a captured model's capture arguments make; "loaded": as a worker now gets them)
    model = {**{k: req[k] for k in ("factory", "args", "capture")}, "pieces": "loaded"} \
        if req["capture"] is not None else req["factory"]
    return json.dumps([*_software(), req["preload"], model], sort_keys=True)


def measure(req: dict[str, Any]) -> int:
    """A fresh worker-like process's peak resident bytes (see the module's docstring); 0 where that cannot be
    read (no /proc) or the process fails."""
    from gpipe.proc import child_env
    from gpipe.worker.agent import MALLOC_ENV

    env = child_env(dict(os.environ, **MALLOC_ENV, OMP_NUM_THREADS="1"))
    try:
        out = subprocess.run([sys.executable, "-P", "-c", _CHILD], input=json.dumps(req), env=env, capture_output=True,
                             text=True, timeout=TIMEOUT_S, check=True).stdout
        return int(out.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0


_seen: dict[str, int] = {}  # this process's answers, by key


def known(plan: Plan, device: str = "cpu") -> int | None:
    """The baseline of a worker of `plan` on `device` where it is known without measuring (CUDA's, or one this
    host measured before); None where it is not."""
    if device.startswith("cuda"):
        return 0
    key = _key(_request(plan))
    if key not in _seen:
        cached = _cached().get(key)
        if not isinstance(cached, int):
            return None
        _seen[key] = cached
    return _seen[key]


def runtime_bytes(plan: Plan, device: str = "cpu") -> int:
    """The baseline of a worker of `plan` on `device` (see the module's docstring): known, else measured now."""
    got = known(plan, device)
    if got is not None:
        return got
    req = _request(plan)
    key = _key(req)
    got = _seen[key] = measure(_with_pieces(req, plan))
    if got:
        try:
            path = cache_file()
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, {**_cached(), key: got})
        except OSError:
            pass
    return got


def _cached() -> dict[str, Any]:
    try:
        cached = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}
