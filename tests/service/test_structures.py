"""Structures across cuts between real processes: dicts, masks, padded sequences, skips over stages and the
examples' U-Net and masked charlm, each equal to one device; validate's one line. Through gpipe.Pipeline:
tests/engine/test_structures.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from gpipe.factory import add_import_paths
from tests.support.runs import train_and_compare
from tests.support.spec import TWO_STAGES, job
from tests.support.structures import CASES, SKIP_CASES


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["dict-mask-1f1b-except_last"])
def test_structures_cross_cuts_as_on_one_device(cli, name):
    train_and_compare(cli, name, CASES[name])


@pytest.mark.multiprocess
def test_validate_exits_2_in_one_line(cli):
    path = cli.write(job(TWO_STAGES, model={"factory": "tests.support.models:bad_cut", "args": {"kind": "tuple_to_linear"}}))
    r = cli.run("validate", str(path), timeout=60)
    assert r.returncode == 2, r.stderr
    line, = r.stderr.strip().splitlines()
    assert line.startswith("error: model: layer 1 (Linear) raised TypeError") and "Traceback" not in r.stderr
    good = cli.write(CASES["dict-mask-1f1b-except_last"], "good.yaml")
    r = cli.run("validate", str(good), timeout=60)
    assert r.returncode == 0 and "ok (5 layers" in r.stdout, r.stderr


# -- skip connections that jump stages --------------------------------------------------------------



@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SKIP_CASES))
def test_skips_jump_stages_as_on_one_device(cli, name):
    spec = SKIP_CASES[name]
    lines = train_and_compare(cli, name, spec)
    batch, stages = spec["data"]["batch_size"], spec["stages"]
    last = stages - 1
    for m in lines:
        st = m["stages"]
        # s (24 floats) and ids (one int64) a sample go straight from stage 0 to the last stage, and s's gradient back
        assert st[0]["sent_bytes"][f"skips to stage {last}"] == batch * (24 * 4 + 8)
        assert st[last]["received_bytes"]["stage 0's skips"] == batch * (24 * 4 + 8)
        assert st[last]["sent_bytes"]["skip gradients to stage 0"] == batch * 24 * 4
        # The stages between carry their neighbours' 16-float activations and gradients, and not a byte more:
        # stage 0's skips reach none of their channels.
        for k in range(1, last):
            neighbours = {f"stage {k - 1}'s activation": st[k]["received_bytes"], f"stage {k + 1}'s gradient":
                          st[k]["received_bytes"], f"activation to stage {k + 1}": st[k]["sent_bytes"],
                          f"gradient to stage {k - 1}": st[k]["sent_bytes"]}
            carried = sum(d[c] for c, d in neighbours.items())
            through = carried - 4 * batch * 16 * 4
            print(f"{name}: step {m['step']}: bytes of stage 0's skips through stage {k}: {through}")
            assert through == 0
            assert not [c for c in [*st[k]["received_bytes"], *st[k]["sent_bytes"]]
                        if c in ("stage 0's skips", "skip gradients to stage 0")]


@pytest.mark.multiprocess
def test_the_unet_example_equals_one_device(cli):
    """examples/unet.yaml, small and brief: enc1 goes from stage 0 to stage 2, enc2 from stage 0 to stage 1."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    add_import_paths([str(examples)])
    shutil.copy(examples / "unet.py", cli.tmp / "unet.py")
    spec = yaml.safe_load((examples / "unet.yaml").read_text())
    width, size, batch = 8, 16, 8
    # sgd: adam would magnify the rounding of gradients summed in another order (the skip's and the pool's)
    spec.update(name="t", steps=3, log_every=1, model={**spec["model"], "args": {"width": width}},
                data={**spec["data"], "args": {"n": 24, "size": size}, "batch_size": batch},
                optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9})
    for m in train_and_compare(cli, "unet", spec):
        enc1, enc2 = batch * width * size * size * 4, batch * 2 * width * (size // 2) ** 2 * 4
        assert m["stages"][0]["sent_bytes"] == {"activation to stage 1": batch * 2 * width * (size // 4) ** 2 * 4,
                                                "skips to stage 1": enc2, "skips to stage 2": enc1}
        assert m["stages"][1]["received_bytes"]["stage 0's skips"] == enc2
        assert m["stages"][2]["received_bytes"]["stage 0's skips"] == enc1


@pytest.mark.multiprocess
def test_the_masked_charlm_example_equals_one_device(cli):
    """examples/charlm-masked.yaml, small: padded buckets of lines, the padding mask crossing the cut."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    add_import_paths([str(examples)])
    shutil.copy(examples / "charlm.py", cli.tmp / "charlm.py")
    spec = yaml.safe_load((examples / "charlm-masked.yaml").read_text())
    spec.update(name="t", steps=4, chunks=3, lr_schedule=None, checkpoint_every=None,
                model={**spec["model"], "args": {"d_model": 16, "heads": 2, "ff": 32, "layers": 2}},
                data={**spec["data"], "args": {"max_len": 24, "batch_size": 8, "max_bytes": 20000}, "batch_size": 8},
                # sgd: adamw would magnify the rounding of gradients summed in another order
                optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9}, balance=[2, 2])
    lines = train_and_compare(cli, "charlm-masked", spec)
    masks = [m["stages"][1]["received_bytes"]["stage 0's activation"] for m in lines]
    assert len(set(masks)) > 1, masks  # the lengths, and so the bytes that cross, change step to step
