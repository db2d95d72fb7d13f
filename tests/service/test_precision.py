"""Mixed precision through `run`: bf16 equals one-device autocast, cuts carry half the bytes, fp16's one loss
scale skips a step on every stage and resumes with its checkpointed scale; bad precisions are one line. In
process: tests/engine/test_precision.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpipe.coordinator.outputs import checkpoint
from tests.support import reference
from tests.support.cli import torch_threads
from tests.support.spec import PRECISION, TWO_STAGES, job


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


SKIPS = {"factory": "tests.support.models:skip_mlp", "args": {"width": 16, "skip_width": 24}}




def overflow(at: list[int]) -> dict:
    """fp16, adam, a checkpoint after every step; the GradOverflow layer (layer 2) makes its weight's gradient
    inf on the forwards numbered in `at` (2 micro-batches a step: forward 2 is step 1's first)."""
    return {"model": {"factory": "tests.support.models:overflow_mlp", "args": {"width": 16, "at": at}},
            "balance": [3, 3], "optimizer": {"name": "adam", "lr": 0.01}, "precision": "fp16",
            "checkpoint_every": 1, "keep_checkpoints": 10}


def run(cli, spec: dict, *flags: str) -> tuple[Path, subprocess.CompletedProcess]:
    r = cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), *flags)
    assert r.returncode == 0, r.stderr
    return cli.tmp / "state" / spec["name"], r




def max_diff(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


# -- bf16 against one-device autocast ----------------------------------------------------------------------

ROUNDED = "3stages-transformer-1f1b-except_last"
# Real processes: skips across cuts, and a Transformer whose values at the cuts are rounded. The rest of the
# matrix (schedules, checkpointing, dropout, adam with clipping) runs through gpipe.Pipeline in
# tests/engine/test_pipeline.py.
SKIPS_BF16 = job(TWO_STAGES, PRECISION, stages=3, balance=[1, 2, 3], model=SKIPS, activation_checkpoint="always")
BF16 = {
    # skip connections from stage 0 to stage 2 (over stage 1; one of them int64) and from stage 1 to stage 2;
    # its run also counts the bytes that cross (test_cuts_carry_half_the_bytes_of_fp32)
    "3stages-skips-checkpoint": SKIPS_BF16,
    # a Transformer LM whose float32 values at the cuts (a positional encoding's sum, the encoder layers'
    # outputs) are rounded to bf16 there, as one-device autocast does not
    ROUNDED: job(TWO_STAGES, PRECISION, stages=3, balance=[2, 2, 2], chunks=3, schedule="1f1b", activation_checkpoint="except_last",
                 model={"factory": "tests.support.models:tiny_lm", "args": {}},
                 data={"factory": "tests.support.models:tokens", "args": {}, "batch_size": 9}, loss="cross_entropy"),
}


@pytest.mark.multiprocess
def test_bf16_weights_equal_one_device_autocast(cli):
    check_bf16(cli, ROUNDED, run(cli, BF16[ROUNDED], "--no-progress")[0])


def check_bf16(cli, name: str, out: Path) -> None:
    """The weights of `BF16[name]`'s run in `out` equal one-device autocast's."""
    spec = BF16[name]
    got = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in got.values())  # the weights stay fp32
    # One device, the forward under autocast, its float32 values rounded to bf16 where the job cuts the model
    # (tests/support/reference.py). Bit for bit when it runs the bf16 kernels with the stages' thread count.
    plan = json.loads((out / "plan.json").read_text())
    single = all(s["threads"] == 1 for s in plan["stages"])
    with torch_threads(1 if single else torch.get_num_threads()):
        rounded = max_diff(got, reference.train(spec, cuts=plan["balance"]))
        plain = max_diff(got, reference.train(spec))
        fp32 = max_diff(got, reference.train({**spec, "precision": "fp32"}))
    print(f"{name}: largest weight difference {rounded:.3g} from one-device bf16 rounded at the cuts, "
          f"{plain:.3g} from plain one-device bf16, {fp32:.3g} from fp32")
    assert rounded <= (1e-6 if single else 1e-3)
    if name != ROUNDED:  # the values at the cuts are bf16 already: plain one-device autocast is the same
        assert plain == rounded
        assert fp32 > 10 * max(rounded, 1e-6)  # bf16 did run: the fp32 weights are farther off
    for m in metrics(out):
        assert m["loss_scale"] is None and m["skipped"] is None  # fp16's alone
        assert all("skipped" not in s for s in m["stages"])


@pytest.mark.multiprocess
def test_cuts_carry_half_the_bytes_of_fp32_and_skips_in_bf16_equal_one_device_autocast(cli):
    # Activations forward, gradients backward and the skip connections: each bf16 cut moves half the bytes.
    sent = {}
    # fp16 casts the same tensors (Precision.cut: test_a_cut_casts_float32_only...)
    for precision, spec in (("fp32", {**SKIPS_BF16, "steps": 1, "precision": "fp32"}), ("bf16", SKIPS_BF16)):
        out, _ = run(cli, {**spec, "name": precision}, "--no-progress")
        m = metrics(out)[0]
        sent[precision] = {(s["stage"], ch): n for s in m["stages"] for ch, n in s["sent_bytes"].items()}
    check_bf16(cli, "3stages-skips-checkpoint", out)
    assert len(sent["fp32"]) == 8 and all(n > 0 for n in sent["fp32"].values())
    # Stage 0's skips to stage 2 are s (24 floats a sample) and ids (an int64 a sample, unchanged); 8 samples.
    mixed = (0, "skips to stage 2")
    assert (sent["fp32"][mixed], sent["bf16"][mixed]) == (8 * (24 * 4 + 8), 8 * (24 * 2 + 8))
    floats = {k: n for k, n in sent["fp32"].items() if k != mixed}  # activations, gradients, skips, skip gradients
    assert {k: 2 * n for k, n in sent["bf16"].items() if k != mixed} == floats


# -- fp16: one loss scale for the job ------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("balance", [[2, 2, 2]], ids=["middle-of-3"])  # first-of-2: tests/engine/test_pipeline.py
def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(cli, balance):
    # Step 1's first micro-batch makes an inf gradient on the stage holding layer 2, and on no other.
    spec = job(TWO_STAGES, PRECISION, overflow([2]), stages=len(balance), balance=balance)
    out, r = run(cli, spec)  # with progress lines (stderr is no terminal)
    lines = metrics(out)
    assert [m["skipped"] for m in lines] == [False, True, False, False]
    assert [m["loss_scale"] for m in lines] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]  # backed off after the skip
    assert all(s["skipped"] for s in lines[1]["stages"])  # every stage agreed
    assert "loss scale 32768" in r.stderr and "(skipped)" in r.stderr

    # Every stage's weights and optimizer state are as step 0 left them (checkpoint step-1 = after step 0).
    before, after = (checkpoint.load(out / "checkpoints" / f"step-{s}") for s in (1, 2))
    assert len(before.stages) == len(balance)
    for k, (a, b) in enumerate(zip(before.stages, after.stages, strict=True)):
        trained = {n: t for n, t in a.tensors.items() if not n.startswith(("rng/", "model/2.calls"))}
        assert trained, f"stage {k} holds nothing"
        assert all(torch.equal(t, b.tensors[n]) for n, t in trained.items()), f"stage {k} changed in a skipped step"
        assert a.optimizer_scalars == b.optimizer_scalars  # adam's step count did not move
        assert b.loss_scale == {"scale": 2.0**15, "growth_tracker": 0}
    # ... and the steps before and after it trained: the weights equal one-device fp16 autocast with
    # torch.amp.GradScaler, which skips the same step.
    third = checkpoint.load(out / "checkpoints" / "step-3")
    assert not torch.equal(after.stages[-1].tensors["model/5.weight"], third.stages[-1].tensors["model/5.weight"])
    want = reference.train(spec)
    assert max_diff(load_file(out / "model.safetensors"), want) <= 1e-5


@pytest.mark.multiprocess
def test_fp16_resume_goes_on_with_the_checkpointed_scale(cli):
    # The scale starts at 1024 and doubles after 2 good steps: step 0 good, step 1 skipped (512), step 2 good,
    # then the checkpoint; resumed, step 3 is the second good one in a row, so step 4's scale is 1024.
    spec = job(TWO_STAGES, PRECISION, overflow([2]), steps=3, loss_scale={"init": 1024.0, "growth_interval": 2})
    out, _ = run(cli, spec, "--no-progress")
    assert [m["loss_scale"] for m in metrics(out)] == [1024, 1024, 512]
    assert checkpoint.load(out / "checkpoints" / "step-3").stages[0].loss_scale == \
        {"scale": 512, "growth_tracker": 1}
    longer = {**spec, "steps": 5}

    # A checkpoint whose scale is out of range (its manifest made to match) is bad input, naming the field.
    forged = cli.tmp / "forged"
    shutil.copytree(cli.tmp / "state", forged)
    d = forged / "t" / "checkpoints" / "step-3"
    state = json.loads((d / "stage-0.json").read_text())
    state["loss_scale"]["scale"] = -1.0
    (d / "stage-0.json").write_text(json.dumps(state))
    manifest = json.loads((d / checkpoint.MANIFEST).read_text())
    data = (d / "stage-0.json").read_bytes()
    manifest["files"]["stage-0.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    before = (forged / "t" / "metrics.jsonl").read_bytes()
    r = cli.run("run", str(cli.write(longer)), "--state-dir", str(forged), "--no-progress", "--resume")
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint step-3: loss_scale.scale:") and "-1.0" in last, r.stderr
    assert (forged / "t" / "metrics.jsonl").read_bytes() == before

    run(cli, longer, "--no-progress", "--resume")
    resumed = [m for m in metrics(out) if m["attempt"] == 2]
    assert [(m["step"], m["loss_scale"], m["skipped"]) for m in resumed] == [(3, 512, False), (4, 1024, False)]
    # torch.amp.GradScaler(init_scale=1024, growth_interval=2) on one device; the GradOverflow layer's count
    # is a checkpointed buffer, so the resumed stage counts on as the reference does.
    assert max_diff(load_file(out / "model.safetensors"), reference.train(longer)) <= 1e-5


@pytest.mark.multiprocess
def test_fp16_resume_from_a_checkpoint_without_a_scale_starts_at_the_initial_scale(cli):
    spec = job(TWO_STAGES, PRECISION, steps=2, precision="bf16")
    out, _ = run(cli, spec, "--no-progress")
    run(cli, {**spec, "steps": 3, "precision": "fp16"}, "--no-progress", "--resume")
    [resumed] = [m for m in metrics(out) if m["attempt"] == 2]
    assert (resumed["step"], resumed["loss_scale"], resumed["skipped"]) == (2, 2.0**16, False)


# -- bad input ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["fp8", "FP16", None])
def test_a_bad_precision_is_one_line_naming_it(cli, value):
    r = cli.run("run", str(cli.write(job(TWO_STAGES, PRECISION, precision=value))), "--state-dir", str(cli.tmp / "state"), "--no-progress")
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith("error: precision:"), r.stderr
    assert not (cli.tmp / "state").exists()


@pytest.mark.parametrize("precision", ["bf16"])  # fp16's check is the same line of Precision's
def test_a_precision_the_device_lacks_is_bad_input(cli, precision):
    # Every process of the run (the CLI, the attempt, the workers) gets a torch without autocast on the CPU,
    # as on a device that lacks it: the plan refuses the job before any stage starts.
    site = cli.tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import torch.amp.autocast_mode as m\nm.is_autocast_available = lambda device_type: False\n")
    cli.env["PYTHONPATH"] = f"{site}:{cli.env['PYTHONPATH']}"
    cli.env.pop("GPIPE_TEMPLATE_SOCKET", None)  # the shared template started without this sitecustomize
    r = cli.run("run", str(cli.write(job(TWO_STAGES, PRECISION, precision=precision))), "--state-dir", str(cli.tmp / "state"),
                "--no-progress")
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: precision: {precision} needs autocast") and "cpu" in last, r.stderr
    assert "Traceback" not in r.stderr and not (cli.tmp / "state" / "t" / "metrics.jsonl").exists()
    cli.env["PYTHONPATH"] = cli.env["PYTHONPATH"].split(":", 1)[1]
    assert cli.run("validate", str(cli.write(job(TWO_STAGES, PRECISION, precision=precision)))).returncode == 0  # the same job, a torch with it


# -- CUDA ----------------------------------------------------------------------------------------------------

def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stages", [1, 2])
def test_cuda_autocast_equals_one_device_autocast(cli, precision, stages):
    if gpus() < stages:
        pytest.skip(f"needs {stages} CUDA device(s) (one per stage: NCCL takes one rank per GPU)")
    spec = job(TWO_STAGES, PRECISION, stages=stages, chunks=2, device="cuda", precision=precision)
    out, _ = run(cli, spec, "--no-progress")
    diff = max_diff(load_file(out / "model.safetensors"), reference.train(spec, device="cuda"))
    print(f"cuda {precision}, {stages} stage(s): largest weight difference {diff:.3g}")
    assert diff <= 1e-3
    lines = metrics(out)
    assert all((m["loss_scale"] is not None) == (precision == "fp16") for m in lines)
    if stages == 2:
        assert lines[0]["stages"][0]["sent_bytes"] == {"activation to stage 1": 2 * 4 * 16 * 2}


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_cuda_fp16_overflow_skips_the_step_on_every_stage(cli):
    if gpus() < 2:
        pytest.skip("needs 2 CUDA devices")
    spec = job(TWO_STAGES, PRECISION, overflow([2]), device="cuda")
    out, _ = run(cli, spec, "--no-progress")
    assert [m["skipped"] for m in metrics(out)] == [False, True, False, False]
    assert max_diff(load_file(out / "model.safetensors"), reference.train(spec, device="cuda")) <= 1e-3
