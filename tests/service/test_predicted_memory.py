"""Each worker's predicted peak (plan.json, validate) against the peak its steps measure, through the CLI."""

from __future__ import annotations

import json

import pytest

from tests.support.spec import job, regression

# Wide enough that the weights, AdamW's state and the activations are some tens of MiB beside the runtime's.
WIDE = {"name": "mem", "seed": 0, "model": {"factory": "mlp", "args": {"width": 512, "depth": 4}},
        "data": regression(512, 512, 256), "chunks": 4, "optimizer": {"name": "adamw", "lr": 1e-3},
        "schedule": "1f1b", "activation_checkpoint": "except_last", "steps": 3}


@pytest.mark.multiprocess
def test_the_predicted_peak_is_within_a_fifth_of_the_measured_one(cli):
    spec = job(WIDE)
    path = cli.write(spec)
    r = cli.run("validate", str(path))
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if "predicted peak" in x]
    assert [x.split(":")[0].strip() for x in lines] == ["rank 0 (stage 0)", "rank 1 (stage 1)"], r.stdout
    assert all("MiB (params " in x and "baseline " in x for x in lines), r.stdout

    r = cli.run("run", str(path), "--state-dir", str(cli.tmp / "st"), "--no-progress")
    assert r.returncode == 0, r.stderr
    out = cli.tmp / "st" / "mem"
    workers = json.loads((out / "plan.json").read_text())["workers"]
    measured: dict[int, int] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        for s in json.loads(line)["stages"]:
            measured[s["rank"]] = max(measured.get(s["rank"], 0), s["peak_memory_bytes"])
    for w in workers:
        parts = w["predicted_memory"]
        assert w["predicted_peak_bytes"] == sum(v for k, v in parts.items() if k != "moment")
        assert parts["params"] > 0 and parts["optimizer"] == 2 * parts["params"]  # AdamW: two moments
        ratio = w["predicted_peak_bytes"] / measured[w["rank"]]
        print(f"rank {w['rank']}: predicted {w['predicted_peak_bytes'] / 2**20:.1f} MiB, measured "
              f"{measured[w['rank']] / 2**20:.1f} MiB, ratio {ratio:.3f}")
        assert 0.8 <= ratio <= 1.2, (w, measured)
