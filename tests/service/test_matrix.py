"""The combinations users run: every pair of model family, schedule, precision, path, replicas and activation
checkpointing, each held against one device on the same micro-batches.

The features are tested one by one elsewhere; here they meet. An all-pairs generator (`all_pairs`) keeps the
cases few: every value of each dimension meets every value of every other in at least one case, and every model
family meets every schedule through `run` (real processes, the job's code importing in each). Each case trains
two steps and compares the weights with one device: fp32 within 1e-5; bf16 and fp16 against one-device autocast
rounded at the cuts (each float32 value that leaves a model chunk cast to the half dtype, as the stages send it),
within the same bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import gpipe
from gpipe.capture.graph import capture, select_output
from gpipe.factory import resolve
from gpipe.precision import DTYPES, LossScaler
from tests.support import reference
from tests.support.cli import Cli, end_leftovers, torch_threads
from tests.support.spec import job

pytest.importorskip("transformers")

# Each family: its model, a data set, its loss. Each cuts into 4 pieces (layers, or captured blocks), so the same
# balance serves every family: [2, 2] on 2 workers, [1, 1, 1, 1] as 2 workers x 2 model chunks.
FAMILIES: dict[str, dict[str, Any]] = {
    "sequential": {"model": {"factory": "mlp", "args": {"width": 16, "depth": 3}},
                   "data": {"factory": "random_regression", "args": {"n": 32, "in_features": 16,
                                                                      "out_features": 16}},
                   "loss": "mse"},
    # A hand-written module captured with torch.export: the stem's output crosses every cut.
    "residual": {"model": {"factory": "tests.support.models:residual_net", "args": {"width": 16, "blocks": 4}},
                 "data": {"factory": "random_regression", "args": {"n": 32, "in_features": 16, "out_features": 16}},
                 "loss": "mse"},
    # GPT-2: its embedding and head one tied weight, on the first and the last model chunk.
    "gpt2": {"model": {"factory": "tests.support.models:gpt2", "args": {}},
             "data": {"factory": "tests.support.models:token_pairs", "args": {"n": 32}}, "loss": "cross_entropy"},
    # Llama with an attention mask (left padding): the forward's keyword inputs.
    "llama": {"model": {"factory": "tests.support.models:llama", "args": {}},
              "data": {"factory": "tests.support.models:masked_pairs", "args": {"n": 32}}, "loss": "cross_entropy"},
}
DIMENSIONS: dict[str, list[Any]] = {
    "model": list(FAMILIES),
    "schedule": ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv"],
    "precision": ["fp32", "bf16", "fp16"],
    "path": ["run", "pipeline", "serve"],
    "replicas": [1, 2],
    "activation_checkpoint": ["never", "except_last", "always"],
}
VIRTUAL = {"interleaved-1f1b", "zbv"}
BATCH, CHUNKS, STEPS = 16, 4, 2  # with 2 replicas, micro-batches of 2 (a dynamic batch dimension, never 1)


def all_pairs(dimensions: dict[str, list[Any]], seeds: Iterable[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Cases (a value for each dimension) in which every value of each dimension meets every value of each other
    dimension at least once: `seeds` first (partial cases, completed), then greedily, each case completed with
    the values that meet the most pairs not yet met. Deterministic."""
    names = list(dimensions)
    unmet = {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
             for va in dimensions[a] for vb in dimensions[b]}

    def met(case: dict[str, Any]) -> set[tuple[tuple[str, Any], tuple[str, Any]]]:
        return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(names, 2) if a in case and b in case}

    def complete(case: dict[str, Any]) -> dict[str, Any]:
        case = dict(case)
        for name in names:
            if name not in case:
                case[name] = max(dimensions[name], key=lambda v: len(met({**case, name: v}) & unmet))
        return case

    cases = []
    for seed in seeds:
        cases.append(complete(seed))
        unmet -= met(cases[-1])
    while unmet:
        (a, va), (b, vb) = min(unmet, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]),
                                                     dimensions[p[0][0]].index(p[0][1]),
                                                     dimensions[p[1][0]].index(p[1][1])))
        cases.append(complete({a: va, b: vb}))
        unmet -= met(cases[-1])
    return cases


# Every model family x schedule through `run` (real processes); GPT-2's tied weight with replicas under serve too
# (the tied holders' sum and the replicas' once undid each other); then whatever pairs are left.
CASES = all_pairs(DIMENSIONS, [*({"model": m, "schedule": s, "path": "run"}
                                 for m in DIMENSIONS["model"] for s in DIMENSIONS["schedule"]),
                               {"model": "gpt2", "replicas": 2, "path": "serve"}])


def case_id(case: dict[str, Any]) -> str:
    ckpt = {"never": "ckpt0", "except_last": "ckpt1", "always": "ckpt2"}[case["activation_checkpoint"]]
    return "-".join([case["path"], case["model"], case["schedule"], case["precision"], f"r{case['replicas']}", ckpt])


def test_every_pair_of_values_meets_in_a_case_and_every_family_meets_every_schedule_through_run():
    for a, b in itertools.combinations(DIMENSIONS, 2):
        for va, vb in itertools.product(DIMENSIONS[a], DIMENSIONS[b]):
            assert any(c[a] == va and c[b] == vb for c in CASES), f"{a}={va} never meets {b}={vb}"
    for m, s in itertools.product(DIMENSIONS["model"], DIMENSIONS["schedule"]):
        assert any(c["model"] == m and c["schedule"] == s and c["path"] == "run" for c in CASES), (m, s)
    everything = 1
    for values in DIMENSIONS.values():
        everything *= len(values)
    assert len(CASES) < everything / 30  # a few dozen cases, not the 1,080 of every combination


def balance(case: dict[str, Any]) -> list[int]:
    return [1, 1, 1, 1] if case["schedule"] in VIRTUAL else [2, 2]


def preset(case: dict[str, Any]) -> dict[str, Any]:
    """The job of one case of the matrix (a preset of tests.support.spec.job): its family's model, data and
    loss, cut as the case says."""
    family = FAMILIES[case["model"]]
    fields = {
        "seed": 0, "model": family["model"], "balance": balance(case), "chunks": CHUNKS,
        "schedule": case["schedule"], "precision": case["precision"], "replicas": case["replicas"],
        "activation_checkpoint": case["activation_checkpoint"],
        "data": {**family["data"], "batch_size": BATCH, "shuffle": False}, "loss": family["loss"],
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "steps": STEPS,
    }
    if case["schedule"] in VIRTUAL:
        fields["virtual_stages"] = 2
    return fields


def _half(v: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t, v)


def one_device(spec: dict[str, Any], cuts: list[int]) -> nn.Module:
    """The job trained on one device, micro-batch after micro-batch, as the pipeline cuts each batch: the model's
    pieces (its layers, or the blocks it is captured into) in order, under autocast with bf16 and fp16, each
    float32 value that leaves a model chunk cast to the half dtype; fp16's loss scaled by torch's GradScaler."""
    with torch_threads(1):
        model = reference.initial_model(spec)
        data = resolve(spec["data"]["factory"])(**spec["data"]["args"])
        loss_fn = resolve(spec["loss"])
        batches = [torch.utils.data.default_collate([data[i] for i in range(s * BATCH, (s + 1) * BATCH)])
                   for s in range(STEPS)]
        micro = [reference.micro_batches(x, y, BATCH, CHUNKS, spec["replicas"]) for x, y in batches]
        half = DTYPES[spec["precision"]]
        # The layers cut at the chunks' bounds: an nn.Sequential's own; a captured model's pieces in half precision
        # (its graph keeps the dtypes it was traced with, where the module's own code would follow autocast's);
        # in fp32, no cut rounds anything: the model itself (None).
        pieces = model if isinstance(model, nn.Sequential) else \
            capture(model, micro[0][0][0]).pieces if half is not None else None
        starts = set(itertools.accumulate(cuts[:-1]))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=LossScaler.INIT, enabled=spec["precision"] == "fp16")
        for step in micro:
            for x, y, size in step:
                out = x
                if pieces is None:
                    out = select_output(model(**x) if isinstance(x, dict) else model(x), None)
                else:
                    with torch.autocast("cpu", dtype=half or torch.bfloat16, enabled=half is not None):
                        for i, piece in enumerate(pieces):
                            if half is not None and i in starts:
                                out = _half(out, half)
                            out = piece(out)
                scaler.scale(loss_fn(out.float(), y) * size / BATCH).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return model


def assert_same(got: dict[str, torch.Tensor], want: nn.Module) -> None:
    """`got` (a pipeline's weights, the model's names; a tied weight may be given once) equals `want`'s."""
    own = want.state_dict()
    assert got and set(got) <= set(own), sorted(set(got) ^ set(own))[:5]
    for k in set(own) - set(got):  # what `got` leaves out is a tied copy of a weight it holds
        assert any(own[k].data_ptr() == own[j].data_ptr() for j in got), k
    worst = max((got[k].float() - own[k].float()).abs().max().item() for k in got)
    assert worst <= 1e-5, f"weights differ from one device by {worst}"


def in_process(case: dict[str, Any], spec: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The job through gpipe.Pipeline (the stages as threads), with the user's own optimizer."""
    with torch_threads(1):
        model = reference.initial_model(spec)
        pipe = gpipe.Pipeline(model, balance(case), chunks=CHUNKS, schedule=case["schedule"],
                              virtual_stages=2 if case["schedule"] in VIRTUAL else 1,
                              activation_checkpoint=case["activation_checkpoint"], precision=case["precision"],
                              replicas=case["replicas"], timeout_s=60)
        data = resolve(spec["data"]["factory"])(**spec["data"]["args"])
        loss_fn = resolve(spec["loss"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        try:
            for s in range(STEPS):
                x, y = torch.utils.data.default_collate([data[i] for i in range(s * BATCH, (s + 1) * BATCH)])
                pipe.step(x, y, loss_fn)
                opt.step()
                opt.zero_grad()
        finally:
            pipe.close()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _load(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


CASE_PARAMS = [pytest.param(c, id=case_id(c), marks=[pytest.mark.multiprocess] if c["path"] != "pipeline" else [])
               for c in CASES]


# Found by the matrix or by users, kept beside it: a tied weight under a split backward in fp16 (the W of the
# head's copy came after the embedding's stage had unscaled the one tensor); a Llama in bf16 (export's float32
# checks on the traced sample).
REGRESSIONS = [{"model": "gpt2", "schedule": "zb-h1", "precision": "fp16", "path": "pipeline", "replicas": 1,
                "activation_checkpoint": "never"},
               {"model": "llama", "schedule": "1f1b", "precision": "bf16", "path": "pipeline", "replicas": 1,
                "activation_checkpoint": "never"}]


@pytest.mark.parametrize("case", [p for p in CASE_PARAMS if p.values[0]["path"] == "pipeline"]
                         + [pytest.param(c, id=case_id(c)) for c in REGRESSIONS])
def test_in_process(case):
    spec = job(preset(case), name="m")
    assert_same(in_process(case, spec), one_device(spec, balance(case)))


@pytest.mark.parametrize("case", [p for p in CASE_PARAMS if p.values[0]["path"] == "run"])
def test_run(case, cli):
    spec = job(preset(case), name="m")
    r = cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESTARTING" not in r.stderr, r.stderr[-3000:]  # each combination runs, not once it is retried
    assert_same(_load(cli.tmp / "state" / "m" / "model.safetensors"), one_device(spec, balance(case)))


# The optimizer's state sharded across the replicas (optimizer.shard): GPT-2's tied weight, its two copies (the
# first and the last model chunk, on one worker under zbv) each sharded among its own copies.
SHARDED = [{"model": "gpt2", "schedule": "zbv", "precision": "fp32", "path": "run", "replicas": 2,
            "activation_checkpoint": "never"},
           {"model": "llama", "schedule": "1f1b", "precision": "bf16", "path": "serve", "replicas": 2,
            "activation_checkpoint": "except_last"}]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c) + "-shard") for c in SHARDED if c["path"] == "run"])
def test_run_sharded(case, cli):
    spec = job(preset(case), name="m", optimizer__shard=True)
    r = cli.run("run", str(cli.write(spec)), "--state-dir", str(cli.tmp / "state"), "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same(_load(cli.tmp / "state" / "m" / "model.safetensors"), one_device(spec, balance(case)))


@pytest.fixture(scope="module")
def serve_four(tmp_path_factory):
    """One serve and four workers (2 stages x 2 replicas) for this module's serve cases."""
    from tests.support.service import Service
    c = Cli(tmp_path_factory.mktemp("matrix"))
    s = Service(c)
    try:
        s.start_serve()
        for rank in range(4):
            s.start_worker(rank)
        yield s
    finally:
        s.stop_all()
        left = end_leftovers(c)
    assert not left, f"processes left behind: {left}"


@pytest.mark.parametrize("case", [p for p in CASE_PARAMS if p.values[0]["path"] == "serve"])
@pytest.mark.timeout(300)  # within the submit's own 240 s, and the serve's start
def test_serve(case, serve_four):
    s = serve_four
    name = case_id(case).replace("_", "-")
    spec = job(preset(case), name=name)
    r = s.client("submit", str(s.cli.write(spec, f"{name}.yaml")), "--follow", "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:] + s.log("serve")[-3000:]
    assert "RESTARTING" not in r.stderr, r.stderr[-3000:]
    assert_same(_load(s.state / name / "model.safetensors"), one_device(spec, balance(case)))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c) + "-shard") for c in SHARDED if c["path"] == "serve"])
def test_serve_sharded(case, serve_four):
    s = serve_four
    name = case_id(case).replace("_", "-") + "-shard"
    spec = job(preset(case), name=name, optimizer__shard=True)
    r = s.client("submit", str(s.cli.write(spec, f"{name}.yaml")), "--follow", "--no-progress", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:] + s.log("serve")[-3000:]
    assert_same(_load(s.state / name / "model.safetensors"), one_device(spec, balance(case)))
