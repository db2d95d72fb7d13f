"""Models bigger than one process, through `run`: per-layer weights equal one device, exact init streams the same
weights, a small-scale run stays within each process's share and resumes bit for bit. Plans in process:
tests/engine/test_scale.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.support import reference
from tests.support.spec import SCALE, job, regression


def run_job(cli, spec: dict, *extra: str, timeout: float = 240) -> str:
    r = cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress", *extra,
                timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("spec", [
    job(SCALE, stages=2, schedule="1f1b"),
    # (sgd: a Linear's bias before a BatchNorm gets only rounding noise for a gradient, which adam would
    # scale up to whole steps)
    job(SCALE, stages=4, balance=[1, 2, 1, 1], init_hook="tests.support.models:init_ones_hook", activation_checkpoint="always"),
], ids=["2stages-reset_parameters", "4stages-hook"])
def test_training_from_per_layer_weights_equals_one_device(cli, spec):
    run_job(cli, spec)
    got = load_file(cli.tmp / "state" / "s" / "model.safetensors")
    want = reference.train(spec)
    assert max(float((got[k] - v).abs().max()) for k, v in want.items()) <= 1e-5


@pytest.mark.multiprocess
def test_exact_init_streams_the_same_weights_as_before(cli):
    spec = job(SCALE, stages=3, init="exact", probe=True, balance="by_time")
    run_job(cli, spec)
    got = load_file(cli.tmp / "state" / "s" / "model.safetensors")
    want = reference.train(spec)
    assert max(float((got[k] - v).abs().max()) for k, v in want.items()) <= 1e-5


# -- the scale run, small -----------------------------------------------------------------

WIDTH, DEPTH, STAGES = 512, 8, 4  # 8 x Linear(512, 512): 8.0 MiB of float32 weights, 2 MiB a stage
ALLOWANCE = 480 << 20  # a process with torch imported (some 320-350 MiB here), its threads and buffers


# A model of DEPTH layers WIDTH wide on STAGES stages, initialised per layer, checkpointed.
SCALED = {
    "name": "scale", "seed": 1, "stages": STAGES, "chunks": 4, "init": "per_layer",
    "model": {"factory": "mlp", "args": {"width": WIDTH, "depth": DEPTH, "head": False}},
    "data": regression(16, WIDTH, 8), "optimizer": {"name": "sgd", "lr": 0.01}, "steps": 3, "checkpoint_every": 2,
}


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def peaks(err: str, out: Path, attempt: int) -> tuple[float, list[int]]:
    """The attempt process's VmHWM (its log line) and each stage process's (metrics.jsonl), in bytes."""
    m = re.search(rf"attempt {attempt}: peak resident memory ([\d.]+) MiB", err)
    assert m, err
    last = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["attempt"] == attempt
    return float(m.group(1)) * 2**20, [s["peak_memory_bytes"] for s in last["stages"]]


@pytest.mark.multiprocess
def test_a_small_scale_run_stays_within_each_process_share_and_resumes_bit_for_bit(cli):
    spec = job(SCALED)
    out = cli.tmp / "state" / "scale"
    err = run_job(cli, spec)
    whole = out / "model.safetensors"
    uninterrupted = file_sha256(whole)
    # Each stage holds its weights and gradients (sgd without momentum: no optimizer state).
    share = WIDTH * (WIDTH + 1) * 4 * 2 * DEPTH // STAGES
    attempt_peak, stage_peaks = peaks(err, out, 1)
    print(f"attempt {attempt_peak / 2**20:.0f} MiB, stages {[p >> 20 for p in stage_peaks]} MiB, share "
          f"{share / 2**20:.1f} MiB")
    assert attempt_peak <= ALLOWANCE
    assert all(p <= 1.25 * share + ALLOWANCE for p in stage_peaks)
    # Resume from the checkpoint after step 2 and train step 2 again.
    manifest = json.loads((out / "checkpoints" / "step-3" / "MANIFEST.json").read_text())
    shutil.rmtree(out / "checkpoints" / "step-3")
    whole.unlink()
    err = run_job(cli, spec, "--resume")
    assert "resuming from checkpoint step-2" in err, err
    assert file_sha256(whole) == uninterrupted
    again = json.loads((out / "checkpoints" / "step-3" / "MANIFEST.json").read_text())
    for k in range(STAGES):  # the whole state (weights, generators) again, byte for byte
        name = f"stage-{k}.safetensors"
        assert again["files"][name]["sha256"] == manifest["files"][name]["sha256"], name
    attempt_peak, stage_peaks = peaks(err, out, 2)
    assert attempt_peak <= ALLOWANCE and all(p <= 1.25 * share + ALLOWANCE for p in stage_peaks)
