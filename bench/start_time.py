"""Start-up: from the command to the end of the first step, gpipe's `run` against torch.distributed.pipelining.

    python bench/start_time.py [--rounds 3] [--only seq,gpt2,validate] [--fresh]
    python bench/start_time.py --export-vs-load [--rounds 3]

Each contender is a whole command, timed from its start to the end of its
job's first step (and to its own end), interleaved round by round; the
figures are medians over rounds, and the ratios gpipe / peer (at most 1.0:
gpipe's first step ends no later).

- seq: a 4-layer nn.Sequential (Linear(64) each), batch 16 in 4 micro-batches,
  2 stages, 1 step of SGD. gpipe: `gpipe-coordinator run job.yaml`. The peer:
  two processes spawned as torchrun would start them (RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT; gloo), each building the model and keeping its
  half, a PipelineStage each (the manual split), ScheduleGPipe.
- gpt2: a GPT-2 of 12 blocks (Hugging Face's GPT2LMHeadModel from a config,
  width 32), token pairs of length 12, batch 8 in 4 micro-batches, cut before
  transformer.h.6, 1 step of SGD. gpipe captures it (torch.export); the peer
  uses torch.distributed.pipelining's own tracer, `pipeline()` with a
  SplitPoint.BEGINNING at transformer.h.6, in each of its two processes.
- validate: `gpipe-coordinator validate` of the gpt2 job against one process
  that imports torch, builds the model and captures it once
  (gpipe.capture.graph.capture on the first micro-batch): what validate cannot
  do without.

`--export-vs-load`: instead, what loading a saved program (torch.export.save, then torch.export.load) would save a
worker against capturing the gpt2 job's model itself, each in a fresh process that has imported torch and
torch._dynamo (as a worker's template has): CPU seconds of importing the model's code, building it on the meta
device and torch.export's capture, against importing what the program's output type needs
(transformers.modeling_outputs) and torch.export.load; and the coordinator's torch.export.save.

gpipe's first step ends where its last stage's does (metrics.jsonl's first
line: each stage's start_unix + busy_s + idle_s); the peer's where its last
rank's optimizer step returns. With --fresh each gpipe run gets a new state
folder (nothing of an earlier run kept: a job run for the first time); by
default the state folder stays across rounds, as when a user runs a job again.
A first untimed round warms the file caches (and gpipe's per-host baseline,
gpipe.coordinator.plan.baseline).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COORDINATOR = str(Path(sys.executable).parent / "gpipe-coordinator")

MODELS = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset


def seq(width: int = 64, depth: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def regression(n: int = 64, width: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, width, generator=g))


def gpt2(vocab: int = 97, width: int = 32, layers: int = 12, heads: int = 4) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=width, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def tokens(n: int = 32, length: int = 12, vocab: int = 97) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (n, length + 1), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])
'''

WIDTH, DEPTH, N_SEQ, BATCH_SEQ = 64, 4, 64, 16
LAYERS, N_TOKENS, BATCH_TOKENS, CUT = 12, 32, 8, "transformer.h.6"
CHUNKS = 4
JOBS = {
    "seq": {"name": "seq", "model": {"factory": "start_models:seq", "args": {"width": WIDTH, "depth": DEPTH}},
            "stages": 2, "chunks": CHUNKS, "balance": [2, 2],
            "data": {"factory": "start_models:regression", "args": {"n": N_SEQ, "width": WIDTH},
                     "batch_size": BATCH_SEQ, "shuffle": False},
            "loss": "mse", "optimizer": {"name": "sgd", "lr": 0.01}, "steps": 1},
    "gpt2": {"name": "gpt2", "model": {"factory": "start_models:gpt2", "args": {"layers": LAYERS},
                                       "split_points": [CUT]},
             "stages": 2, "chunks": CHUNKS,
             "data": {"factory": "start_models:tokens", "args": {"n": N_TOKENS}, "batch_size": BATCH_TOKENS,
                      "shuffle": False},
             "loss": "cross_entropy", "optimizer": {"name": "sgd", "lr": 0.01}, "steps": 1},
}


def env(folder: Path) -> dict[str, str]:
    """Every contender's: one thread per process (gpipe's workers run so on a core each), the job's folder
    importable for the peer, and whatever PYTHONPATH the bench was given (another checkout's, say)."""
    paths = [str(folder), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))


def prepare(folder: Path) -> None:
    import yaml

    (folder / "start_models.py").write_text(MODELS)
    for name, spec in JOBS.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(spec))


def first_step_end(job_dir: Path) -> float:
    """When gpipe's first step ended (unix time): its last stage's end, from metrics.jsonl's first line."""
    first = json.loads((job_dir / "metrics.jsonl").read_text().splitlines()[0])
    return max(s["start_unix"] + s["busy_s"] + s["idle_s"] for s in first["stages"])


def gpipe_run(kind: str, folder: Path, state: Path) -> tuple[float, float]:
    """(seconds to the end of the first step, seconds to the command's end) of `gpipe-coordinator run`."""
    t0 = time.time()
    r = subprocess.run([COORDINATOR, "run", f"{kind}.yaml", "--state-dir", str(state), "--no-progress"],
                       cwd=folder, env=env(folder), capture_output=True, text=True, timeout=900)
    t1 = time.time()
    if r.returncode:
        raise RuntimeError(f"gpipe run {kind} failed: {r.stderr[-3000:]}")
    return first_step_end(state / kind) - t0, t1 - t0


def peer_run(kind: str, folder: Path) -> tuple[float, float]:
    """The same for two processes of torch.distributed.pipelining, spawned as torchrun would start them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--peer", kind], cwd=folder,
                              env=dict(env(folder), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    t1 = time.time()
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise RuntimeError(f"the peer's {kind} failed: {err[-3000:]}")
    return max(float(out.strip().splitlines()[-1]) for out, _ in outs) - t0, t1 - t0


def validate_run(folder: Path) -> tuple[float, float]:
    t0 = time.time()
    r = subprocess.run([COORDINATOR, "validate", "gpt2.yaml"], cwd=folder, env=env(folder), capture_output=True,
                       text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"validate failed: {r.stderr[-3000:]}")
    took = time.time() - t0
    return took, took


def capture_run(folder: Path) -> tuple[float, float]:
    t0 = time.time()
    r = subprocess.run([sys.executable, __file__, "--capture"], cwd=folder, env=env(folder), capture_output=True,
                       text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"the capture failed: {r.stderr[-3000:]}")
    took = time.time() - t0
    return took, took


# The peer's processes, and the one capture.

def peer(kind: str) -> None:
    """One rank of the peer's job: prints the time its first step's optimizer step returned."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining as pp

    start_models = importlib.import_module("start_models")  # the job's folder's, on PYTHONPATH
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if kind == "seq":
        model = start_models.seq(WIDTH, DEPTH)
        data = start_models.regression(N_SEQ, WIDTH)
        part = model[:DEPTH // 2] if rank == 0 else model[DEPTH // 2:]
        stage = pp.PipelineStage(part, rank, 2, torch.device("cpu"))
        loss_fn, batch = F.mse_loss, BATCH_SEQ
    else:
        model = start_models.gpt2(layers=LAYERS)
        data = start_models.tokens(N_TOKENS)
        x_mb = data.tensors[0][:BATCH_TOKENS // CHUNKS]
        pipe = pp.pipeline(model, mb_args=(x_mb,), split_spec={CUT: pp.SplitPoint.BEGINNING})
        stage = pipe.build_stage(rank, torch.device("cpu"))
        part = stage.submod

        def loss_fn(out: object, y: torch.Tensor) -> torch.Tensor:
            logits = out[0] if isinstance(out, tuple | list) else getattr(out, "logits", out)
            assert isinstance(logits, torch.Tensor)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

        batch = BATCH_TOKENS
    sched = pp.ScheduleGPipe(stage, CHUNKS, loss_fn=loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=0.01)
    x, y = data.tensors[0][:batch], data.tensors[1][:batch]
    opt.zero_grad()
    if rank == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=[])
    opt.step()
    print(time.time(), flush=True)
    dist.destroy_process_group()


def one_capture() -> None:
    """torch imported, the gpt2 job's model built and captured once, as validate must."""
    import torch

    from gpipe.capture import graph as capture

    start_models = importlib.import_module("start_models")

    torch.manual_seed(0)
    model = start_models.gpt2(layers=LAYERS)
    x = start_models.tokens(N_TOKENS).tensors[0][:BATCH_TOKENS // CHUNKS]
    capture.capture(model, x, [CUT])


def export_or_load(how: str, program: str) -> None:
    """One process's CPU seconds (printed) of the worker's capture (`export`, saving the program to `program`:
    its seconds printed second) or of loading it (`load`)."""
    import torch
    import torch._dynamo  # noqa: F401  - a worker's template has it

    t = time.process_time()
    if how == "export":
        from gpipe.capture import graph as capture
        from gpipe.capture import skeleton

        start_models = importlib.import_module("start_models")
        model, _ = skeleton.skeleton(lambda: start_models.gpt2(layers=LAYERS))
        ep = capture.export(model, torch.zeros(BATCH_TOKENS // CHUNKS, 12, dtype=torch.long, device="meta"))
        took = time.process_time() - t
        t = time.process_time()
        torch.export.save(ep, program)
        print(took, time.process_time() - t)
    else:
        importlib.import_module("transformers.modeling_outputs")  # the output's type, which the program names
        torch.export.load(program)
        print(time.process_time() - t)


def export_vs_load(rounds: int) -> None:
    folder = Path(tempfile.mkdtemp(prefix="start-time-"))
    prepare(folder)
    program = str(folder / "gpt2.pt2")
    took: dict[str, list[float]] = {"capture (import, build on meta, export)": [], "save": [],
                                    "load (import the output's type, load)": []}
    try:
        for r in range(rounds + 1):
            got = []
            for how in ("export", "load"):
                out = subprocess.run([sys.executable, __file__, "--export-or-load", how, program], cwd=folder,
                                     env=env(folder), capture_output=True, text=True, timeout=900, check=True)
                got += [float(x) for x in out.stdout.split()]
            if r:
                for name, x in zip(took, got, strict=True):
                    took[name].append(x)
            print(f"  round {r}{' (warm-up)' if not r else ''}: " + ", ".join(f"{x:.2f}" for x in got), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    med = {name: statistics.median(v) for name, v in took.items()}
    for name, x in med.items():
        print(f"  {name:42s} {x:6.2f} CPU s (median of {rounds})")
    capture, _, load = med.values()
    print(f"  load / capture: {load / capture:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="seq,gpt2,validate")
    ap.add_argument("--fresh", action="store_true", help="a new state folder for every gpipe run")
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--capture", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--export-vs-load", action="store_true", help="a worker's capture against loading a saved "
                    "program, CPU seconds")
    ap.add_argument("--export-or-load", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer:
        return peer(a.peer)
    if a.capture:
        return one_capture()
    if a.export_or_load:
        return export_or_load(*a.export_or_load)
    if a.export_vs_load:
        return export_vs_load(a.rounds)
    wanted = a.only.split(",")
    folder = Path(tempfile.mkdtemp(prefix="start-time-"))
    prepare(folder)
    state = folder / "state"
    runs = 0

    def ours(kind: str) -> Callable[[], tuple[float, float]]:
        def go() -> tuple[float, float]:
            nonlocal runs
            runs += 1
            where = state / str(runs) if a.fresh else state
            return gpipe_run(kind, folder, where)
        return go

    contenders: list[tuple[str, Callable[[], tuple[float, float]]]] = []
    pairs: list[tuple[str, str, str]] = []
    for kind in ("seq", "gpt2"):
        if kind in wanted:
            contenders += [(f"peer {kind}", lambda k=kind: peer_run(k, folder)), (f"gpipe {kind}", ours(kind))]
            pairs.append((f"gpipe {kind}", f"peer {kind}", f"{kind}: gpipe run / peer"))
    if "validate" in wanted:
        contenders += [("torch + one capture", lambda: capture_run(folder)), ("gpipe validate", lambda: validate_run(folder))]
        pairs.append(("gpipe validate", "torch + one capture", "gpt2: validate / (torch + one capture)"))
    load = os.getloadavg()[0]
    print(f"{a.rounds} round(s) (+1 warm-up), {len(os.sched_getaffinity(0))} core(s), load average {load:.1f} "
          f"at the start; folder {folder}", flush=True)
    took: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in contenders}
    try:
        for r in range(a.rounds + 1):
            for name, go in contenders:
                got = go()
                if r:
                    took[name].append(got)
                print(f"  round {r}{' (warm-up)' if not r else ''} {name}: first step {got[0]:.2f} s, "
                      f"end {got[1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    med = {name: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for name, v in took.items()}
    print(f"\nmedians of {a.rounds} round(s) (load average {os.getloadavg()[0]:.1f} at the end):")
    for name, (first, end) in med.items():
        print(f"  {name:24s} first step {first:7.2f} s   command's end {end:7.2f} s")
    print()
    for ours_name, theirs, label in pairs:  # issue 58's targets are for the command's end; the first step's beside
        for k, what in ((1, "command's end"), (0, "first step")):
            rounds = [o[k] / t[k] for o, t in zip(took[ours_name], took[theirs], strict=True)]
            print(f"  {label}, {what}: {med[ours_name][k] / med[theirs][k]:.2f}x (per round: "
                  f"{', '.join(f'{x:.2f}' for x in rounds)})")


if __name__ == "__main__":
    main()
