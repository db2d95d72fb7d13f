"""Submitting: `gpipe-coordinator submit job.yaml` against `gpipe-coordinator validate job.yaml`, side by side.

    python bench/submit_time.py [--rounds 3] [--only seq,gpt2]

Each contender is a whole process, from exec to exit, run interleaved round by round after an untimed
warm-up round; the figures are medians over rounds, and the ratios submit / validate, per round and of the
medians. The jobs are bench/start_time.py's, each in a folder of its own with its model file (what submit
packs as the job's code):

- seq: a 4-layer nn.Sequential (Linear(64) each), 2 stages, 4 micro-batches;
- gpt2: a GPT-2 of 12 blocks (Hugging Face's GPT2LMHeadModel from a config, width 32), cut before
  transformer.h.6 and captured (torch.export).

- validate: `gpipe-coordinator validate job.yaml` in the job's folder.
- submit: `gpipe-coordinator submit job.yaml --name <unique>` to one `serve` on a free port of 127.0.0.1,
  with tokens and a state folder of its own (bench/memory_flat.py's Service), started once before the
  rounds; exit 0 required. serve has no workers: a job that passes its checks is queued, PENDING (the
  bench checks submit's answer says so), then stopped and deleted, untimed, so that the queue does not grow.

What submit's return means: the job is validated and queued. The client parses the spec, packs the job's
folder and uploads it (UploadCode), then SubmitJob waits (up to 300 s) for serve's answer
(coordinator/cli/client.py, Client.submit); serve answers only once it has parsed the spec, validated it in
a throwaway `gpipe-coordinator validate` process forked from its template (torch imported once) and waited
for that process to exit, and then written the job's record and queued it
(coordinator/server/submissions.py, Coordinator.submit and Coordinator._validate). So submit's time holds
a validation of its own, serve's, besides the client's start, the packing and the upload. serve's template
starts on its first fork: the warm-up round's submit pays for it, the timed ones do not.

Every process runs with OMP_NUM_THREADS=1 (serve too, and so its validations), the job's folder on
PYTHONPATH as bench/start_time.py's env() has it.

Target (issue 58): `submit job.yaml` returns within 2x `validate job.yaml`'s own time: submit / validate
at most 2.0.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_flat import Service  # noqa: E402
from start_time import COORDINATOR, JOBS, MODELS, env  # noqa: E402

KINDS = ("seq", "gpt2")
TARGET = 2.0
TIMEOUT_S = 600  # one validate or submit: a validation of serve's may take 120 s, on a busy machine more
VERB_TIMEOUT_S = 120  # stop, delete


def prepare(folder: Path, kinds: list[str]) -> dict[str, Path]:
    """Per kind, a folder of its own with the model file and job.yaml: what submit packs, and nothing else."""
    import yaml

    out = {}
    for kind in kinds:
        d = folder / kind
        d.mkdir()
        (d / "start_models.py").write_text(MODELS)
        (d / "job.yaml").write_text(yaml.safe_dump(JOBS[kind]))
        out[kind] = d
    return out


def timed(argv: list[str], job: Path, what: str) -> tuple[float, str]:
    """(seconds from exec to exit, stderr) of one command in the job's folder; RuntimeError unless exit 0."""
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=job, env=env(job), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    took = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"{what} exited {r.returncode}: {r.stderr.strip()[-3000:]}")
    return took, r.stderr


def validate(job: Path) -> float:
    return timed([COORDINATOR, "validate", "job.yaml"], job, "validate")[0]


def submit(service: Service, job: Path, name: str) -> float:
    """submit's seconds; then the queued job stopped and deleted (untimed)."""
    remote = ["--coordinator", service.address, *service.client_auth]
    try:
        took, err = timed([COORDINATOR, "submit", "job.yaml", "--name", name, *remote], job, f"submit {name}")
    except RuntimeError as e:
        raise RuntimeError(f"{e}{service.logs()}") from None
    if not re.search(rf"^{re.escape(name)}: submitted \(PENDING\)$", err, re.M):
        raise RuntimeError(f"submit {name}: not queued as PENDING: {err.strip()[-2000:]}")
    for verb in (["stop", name], ["delete", name, "--yes"]):
        r = subprocess.run([COORDINATOR, *verb, *remote], cwd=job, env=env(job), stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=VERB_TIMEOUT_S)
        if r.returncode:
            raise RuntimeError(f"{verb[0]} {name} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return took


def validating(job: Path) -> Callable[[int], float]:
    return lambda _round: validate(job)


def submitting(service: Service, job: Path, kind: str) -> Callable[[int], float]:
    """Round r's submit, as job `kind-rR`: a name of its own each round."""
    return lambda r: submit(service, job, f"{kind}-r{r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(KINDS), help="the jobs: seq, gpt2 (default both)")
    a = ap.parse_args()
    wanted = [k for k in KINDS if k in a.only.split(",")]
    if not wanted or set(a.only.split(",")) - set(KINDS):
        ap.error(f"--only: some of {', '.join(KINDS)}")
    if a.rounds < 1:
        ap.error("--rounds: at least 1")
    os.environ["OMP_NUM_THREADS"] = "1"  # serve's (memory_flat's env() is os.environ's), and so its validations'
    folder = Path(tempfile.mkdtemp(prefix="submit-time-"))
    service = Service(folder / "service")
    load = os.getloadavg()[0]
    print(f"{a.rounds} round(s) (+1 warm-up), {len(os.sched_getaffinity(0))} core(s), load average {load:.1f} "
          f"at the start; folder {folder}", flush=True)
    took: dict[str, list[float]] = {}
    try:
        jobs = prepare(folder, wanted)
        service.start(0)  # serve alone: a submitted job is queued, no worker runs it
        contenders: list[tuple[str, Callable[[int], float]]] = []
        for kind in wanted:
            contenders += [(f"validate {kind}", validating(jobs[kind])),
                           (f"submit {kind}", submitting(service, jobs[kind], kind))]
        took = {name: [] for name, _ in contenders}
        for r in range(a.rounds + 1):
            got: dict[str, float] = {}
            for name, go in contenders:
                got[name] = go(r)
                if r:
                    took[name].append(got[name])
                print(f"  round {r}{' (warm-up)' if not r else ''} {name}: {got[name]:.2f} s", flush=True)
            print(f"  round {r}: submit / validate: " + ", ".join(
                f"{k} {got[f'submit {k}'] / got[f'validate {k}']:.2f}x" for k in wanted), flush=True)
    finally:
        service.stop()
        shutil.rmtree(folder, ignore_errors=True)
    med = {name: statistics.median(v) for name, v in took.items()}
    print(f"\nmedians of {a.rounds} round(s) (load average {os.getloadavg()[0]:.1f} at the end):")
    for name, x in med.items():
        print(f"  {name:16s} {x:7.2f} s")
    print()
    for kind in wanted:
        ours, theirs = f"submit {kind}", f"validate {kind}"
        ratio = med[ours] / med[theirs]
        rounds = [o / t for o, t in zip(took[ours], took[theirs], strict=True)]
        print(f"  {kind}: submit / validate: {ratio:.2f}x (per round: {', '.join(f'{x:.2f}' for x in rounds)}); "
              f"target at most {TARGET:.1f}x: {'met' if ratio <= TARGET else 'missed'}")


if __name__ == "__main__":
    main()
