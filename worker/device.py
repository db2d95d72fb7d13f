"""A worker's device: `cpu` or `cuda:K`, checked in a short child process that alone touches CUDA.

Why a child: a process that initialised CUDA cannot hand CUDA on to the
processes forked from it, and a worker's attempt processes are forked from a
template (gpipe.service.zygote), which is itself started by the daemon (or by `run`).
So neither the `gpipe-worker` daemon nor any coordinator process imports CUDA
to learn what GPUs there are: they run `python -m gpipe.worker.device`, bounded
by PROBE_TIMEOUT_S, which prints one line of JSON and exits:

    {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85045379072, "uuid": "GPU-..."}, ...],
     "torch_cuda": "12.4", "visible": "0,1"}

`gpus` are those torch sees (CUDA_VISIBLE_DEVICES honoured), by index: cuda:K
is gpus[K]. `torch_cuda` is torch's CUDA version (null: a CPU build of torch);
`visible` is CUDA_VISIBLE_DEVICES as the probe had it (null: not set).

Test hook: with env GPIPE_FAKE_GPUS=N (read here only, by the child) the probe
imports nothing and reports N GPUs named "fake GPU K" of 0 bytes, so tests on a
machine without a GPU can walk the paths that count GPUs. Nothing can run on
them: a job placed there fails as soon as it touches CUDA.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from gpipe.errors import GpipeError

PROBE_TIMEOUT_S = 60.0  # importing torch on a loaded machine, then CUDA's start-up
FAKE_GPUS_ENV = "GPIPE_FAKE_GPUS"  # the test hook above
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
DEVICE_RE = re.compile(r"cuda:(\d{1,4})")


@dataclass(frozen=True)
class Gpu:
    """One GPU as the probe saw it. `uuid` tells two GPUs apart across CUDA_VISIBLE_DEVICES lists ('' unknown)."""

    name: str
    memory_bytes: int
    uuid: str = ""

    def describe(self) -> str:
        """'NVIDIA H100 80GB HBM3, 79.2 GiB'."""
        return f"{self.name}, {self.memory_bytes / 2**30:.1f} GiB"


@dataclass(frozen=True)
class Gpus:
    """What torch sees on this machine: its GPUs by index, and why there may be none."""

    gpus: list[Gpu]
    torch_cuda: str | None  # None: torch is a CPU build
    visible: str | None  # CUDA_VISIBLE_DEVICES as the probe had it

    def describe(self) -> str:
        """How many GPUs torch sees here, and what limits them: for a message that refuses a device."""
        why = []
        if self.torch_cuda is None:
            why.append("torch is a CPU build")
        if self.visible is not None:
            why.append(f"{VISIBLE_ENV}={self.visible!r}")
        if not self.gpus:
            return "torch sees no GPU on this machine" + (f" ({', '.join(why)})" if why else "")
        names = f"cuda:0 .. cuda:{len(self.gpus) - 1}" if len(self.gpus) > 1 else "cuda:0"
        return f"torch sees {len(self.gpus)} GPU(s) on this machine ({', '.join([names, *why])})"


def index_of(device: str) -> int | None:
    """`cpu` -> None, `cuda:K` -> K; anything else is a GpipeError naming --device."""
    if device == "cpu":
        return None
    m = DEVICE_RE.fullmatch(device)
    if m is None:
        raise GpipeError(f"--device: {device!r} is neither cpu nor cuda:K (K: a GPU's index, e.g. cuda:0)")
    return int(m.group(1))


def probe(env: dict[str, str] | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> Gpus:
    """The GPUs torch sees with `env` (default: this process's), asked of a child process: this one never
    touches CUDA. A probe that fails or hangs is a GpipeError saying so."""
    what = f"{sys.executable} -P -m gpipe.worker.device"
    try:
        r = subprocess.run([sys.executable, "-P", "-m", "gpipe.worker.device"], capture_output=True, text=True,
                           timeout=timeout_s, env=dict(os.environ if env is None else env), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise GpipeError(f"the GPU probe ({what}) did not answer within {timeout_s:.0f} s") from None
    lines = r.stderr.strip().splitlines()
    try:
        if r.returncode != 0:
            raise ValueError(lines[-1] if lines else f"exit {r.returncode}")
        m = json.loads(r.stdout)
        gpus = [Gpu(str(g["name"]), int(g["memory_bytes"]), str(g.get("uuid") or "")) for g in m["gpus"]]
        return Gpus(gpus, m.get("torch_cuda"), m.get("visible"))
    except (ValueError, KeyError, TypeError) as e:
        raise GpipeError(f"the GPU probe ({what}) failed: {e}") from None


def check(device: str) -> Gpu | None:
    """The GPU `device` names, checked by a probe; None for cpu (no probe). GpipeError naming --device, what is
    wrong and what this machine has, if it is malformed or no GPU of that index is seen."""
    k = index_of(device)
    if k is None:
        return None
    seen = probe()
    if k >= len(seen.gpus):
        raise GpipeError(f"--device: {device}, but {seen.describe()}")
    return seen.gpus[k]


def _look() -> dict[str, object]:
    """In the probe: what torch sees (or the test hook's fake GPUs)."""
    visible = os.environ.get(VISIBLE_ENV)
    fake = os.environ.get(FAKE_GPUS_ENV, "")
    if fake:
        gpus = [{"name": f"fake GPU {k}", "memory_bytes": 0, "uuid": f"GPU-fake-{k}"} for k in range(int(fake))]
        return {"gpus": gpus, "torch_cuda": "fake", "visible": visible}
    import torch

    gpus = []
    for k in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(k)
        uuid = str(getattr(p, "uuid", "") or "")
        uuid = uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}"
        gpus.append({"name": p.name, "memory_bytes": int(p.total_memory), "uuid": uuid})
    return {"gpus": gpus, "torch_cuda": torch.version.cuda, "visible": visible}


if __name__ == "__main__":
    try:
        print(json.dumps(_look()), flush=True)
    except Exception as e:  # one line for the parent's message, no traceback
        print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
