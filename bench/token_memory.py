"""The coordinator's peak memory on a large token file against the same job's on a 1 MB one.

    python bench/token_memory.py                 # a 420 MB file and a 1 MB one: about 2 minutes
    python bench/token_memory.py --mb 2000       # a larger corpus (the disk must hold it)

Two uint16 token files of random ids below GPT-2's vocabulary (50257) are written in a temporary folder,
8 M tokens at a time, and deleted at the end: one of `--mb` MB, one of 1 MB. The same job then runs through
`gpipe-coordinator run` on each: tests.support.models' tiny_lm (an embedding of the 50257 ids, 2 transformer
layers of width 32, a head) on 2 stages, `data: {factory: tokens, seq_len: 64}`, shuffle on, batches of 16
windows, `--steps` steps (each step reads 16 windows from anywhere in the file, one read each: gpipe.data.tokens;
the shuffle keeps a permutation of every window, 4 bytes each: gpipe.coordinator.plan.data). The data is read by the
coordinator only: `run`'s supervisor process opens the files to validate the job, its attempt process reads
every step's windows.

Reported: each process's peak resident memory (VmHWM from /proc/<pid>/status, polled every 0.2 s: file pages
mapped count, as they do for the kernel), on each file, and the difference, against the target: the
coordinator's processes within 64 MiB of the 1 MB file's figure (issue "The language-model recipe").
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import run  # noqa: E402  # the same run and VmHWM watcher

VOCAB = 50257
CHUNK = 8 << 20  # tokens written at a time
TARGET = 64 << 20  # the coordinator's peak on the large file, above the small file's
COORDINATOR = ("run (supervisor)", "coordinator attempt")


def write_tokens(path: Path, tokens: int, seed: int) -> None:
    """`tokens` random uint16 ids below VOCAB, written CHUNK at a time."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for start in range(0, tokens, CHUNK):
            rng.integers(0, VOCAB, min(CHUNK, tokens - start), dtype=np.uint16).tofile(f)


def job(path: Path, steps: int) -> dict[str, object]:
    return {
        "name": "tok", "seed": 0, "stages": 2, "balance": [2, 3], "chunks": 2,
        "model": {"factory": "tests.support.models:tiny_lm",
                  "args": {"vocab": VOCAB, "d_model": 32, "layers": 2, "dropout": 0.0}},
        "data": {"factory": "tokens", "args": {"path": str(path), "seq_len": 64, "dtype": "uint16"},
                 "batch_size": 16, "shuffle": True},
        "loss": "cross_entropy", "optimizer": {"name": "adamw", "lr": 0.001}, "steps": steps,
    }


def kind(pid: int, name: str) -> str:
    """The process's part: a fork of the attempt template says it in its comm (gpipe.service.zygote), not its cmdline."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        comm = ""
    return {"gpipe:attempt": "coordinator attempt", "gpipe:worker": "worker"}.get(comm, name)


def measure(folder: Path, data: Path, steps: int) -> dict[str, int]:
    """Run the job on `data`; each part's peak VmHWM (the largest of its processes), by part."""
    folder.mkdir()
    (folder / "job.yaml").write_text(yaml.safe_dump(job(data, steps)))
    _, peaks = run(folder, uuid.uuid4().hex)
    out: dict[str, int] = {}
    for pid, (name, hwm) in peaks.items():
        part = kind(pid, name)
        out[part] = max(out.get(part, 0), hwm)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=420, help="the large file's size in MB (default 420)")
    ap.add_argument("--steps", type=int, default=30, help="steps of each run (default 30)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpipe-token-memory-"))
    try:
        files = {"1 MB": (tmp / "small.bin", 10**6 // 2), f"{args.mb} MB": (tmp / "large.bin", args.mb * 10**6 // 2)}
        t0 = time.perf_counter()
        for k, (path, tokens) in enumerate(files.values()):
            write_tokens(path, tokens, k)
        print(f"wrote {sum(p.stat().st_size for p, _ in files.values()) / 1e6:.0f} MB of tokens in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        peaks = {label: measure(tmp / f"run-{k}", path, args.steps) for k, (label, (path, _)) in
                 enumerate(files.items())}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    small, large = peaks.values()
    labels = list(peaks)
    windows = args.mb * 10**6 // 2 // 64
    print(f"\npeak resident memory (VmHWM, MiB), {args.steps} steps of 16 shuffled windows of 64 tokens "
          f"({windows:,} windows in the large file):")
    print(f"| process | {labels[0]} | {labels[1]} | difference |")
    print("| --- | ---: | ---: | ---: |")
    for part in sorted(set(small) | set(large), key=lambda p: (p not in COORDINATOR, p)):
        a, b = small.get(part, 0), large.get(part, 0)
        print(f"| {part} | {a / 2**20:.1f} | {b / 2**20:.1f} | {(b - a) / 2**20:+.1f} |")
    worst = max(large.get(p, 0) - small.get(p, 0) for p in COORDINATOR)
    verdict = "met" if worst <= TARGET else "MISSED"
    print(f"\nthe coordinator's processes: at most {worst / 2**20:+.1f} MiB on the {labels[1]} file "
          f"(target: within {TARGET >> 20} MiB): {verdict}")


if __name__ == "__main__":
    main()
