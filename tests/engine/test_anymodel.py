"""Any nn.Module, not only nn.Sequential (gpipe.capture.graph): Hugging Face causal LMs and hand-written modules,
split by name or at their repeated blocks, tied weights kept tied, against one device on the same micro-batches.

Most run through gpipe.Pipeline (the service's stages as threads); the service's own path, real processes
over gloo, is the `run`s at the end of this file.

In process; the runs through real processes are in tests/service/test_anymodel.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

import gpipe
from gpipe import cuts
from gpipe.capture.graph import CaptureError, capture, select_output
from tests.support import models
from tests.support.lm import _cut, batches, fresh, lm_loss, one_device, one_device_job
from tests.support.spec import GPT2, job

pytest.importorskip("transformers")










def pipelined(model, data, chunks: int, loss_fn=lm_loss, lr: float = 0.1, **kw) -> tuple[list[float], gpipe.Pipeline]:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    pipe = gpipe.Pipeline(model, chunks=chunks, **kw)
    losses = []
    for x, y in data:
        losses.append(pipe.step(x, y, loss_fn).item())
        opt.step()
        opt.zero_grad()
    pipe.close()
    return losses, pipe


def assert_same_weights(got, want, tolerance: float = 1e-5) -> None:
    g, w = dict(got.named_parameters()), dict(want.named_parameters())
    assert set(g) == set(w)
    worst = max((g[k] - w[k]).abs().max().item() for k in w)
    assert worst <= tolerance, f"weights differ from one device by {worst}"




@pytest.mark.parametrize(("cut", "schedule", "checkpointing"), [
    ({"split_points": ["transformer.h.2"]}, "gpipe", "never"),
    ({"split_points": ["transformer.h.2"]}, "1f1b", "except_last"),
    ({"split_points": ["transformer.h.1", "transformer.h.3"]}, "1f1b", "never"),
    ({"stages": 3}, "gpipe", "always"),
    ({"balance": [1, 3]}, "1f1b", "never"),
    ({"split_points": ["transformer.h.1", "transformer.h.3"]}, "zb-h1", "except_last"),
    ({"stages": 2, "virtual_stages": 2}, "interleaved-1f1b", "never"),
    ({"stages": 2, "virtual_stages": 2}, "zbv", "always"),  # the embedding and the head on one worker, a V
])
def test_gpt2_with_tied_weights_equals_one_device(cut, schedule, checkpointing):
    data = batches(3, 8, 10)
    want = fresh(models.gpt2)
    want_losses = one_device(want, data, chunks=4)
    got = fresh(models.gpt2)
    losses, pipe = pipelined(got, data, chunks=4, schedule=schedule, activation_checkpoint=checkpointing, **cut)
    assert_same_weights(got, want)
    assert losses == pytest.approx(want_losses, abs=1e-5)
    assert got.transformer.wte.weight is got.lm_head.weight  # still one tensor
    assert pipe.captured is not None
    assert ["0.transformer.wte.weight", f"{len(pipe.captured.pieces) - 1}.transformer.wte.weight"] in \
        pipe.captured.tied
    last = len(pipe.captured.pieces) - 1
    assert cuts.stage_of(pipe.balance, 0) != cuts.stage_of(pipe.balance, last)  # embedding and head apart


def test_gpt2_sequence_lengths_that_change_from_step_to_step_equal_one_device():
    data = batches(4, 6, 7, vary=True)
    want = fresh(models.gpt2)
    one_device(want, data, chunks=3)
    got = fresh(models.gpt2)
    pipelined(got, data, chunks=3, split_points=["transformer.h.2"])
    assert_same_weights(got, want)


@pytest.mark.parametrize(("factory", "mask", "point"), [
    (models.llama, True, "model.layers.2"),
    (models.gpt2, False, "transformer.h.2"),  # each replica keeps its tied weight one tensor
], ids=["llama-mask", "gpt2-tied"])
def test_two_replicas_equal_one_device(factory, mask, point):
    data = batches(3, 8, 9 if mask else 10, mask=mask)
    want = fresh(factory)
    one_device(want, data, chunks=2, replicas=2)
    got = fresh(factory)
    pipelined(got, data, chunks=2, replicas=2, split_points=[point], schedule="1f1b")
    assert_same_weights(got, want)


def test_a_hand_written_module_whose_residual_crosses_every_cut_equals_one_device():
    g = torch.Generator().manual_seed(2)
    data = [({"x": torch.randn(8, 16, generator=g)}, torch.randn(8, 16, generator=g)) for _ in range(3)]
    data = [(x["x"], y) for x, y in data]

    def train_one(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for x, y in data:
            for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
                (F.mse_loss(model(xm), ym) * xm.size(0) / 8).backward()
            opt.step()
            opt.zero_grad()

    want = fresh(models.residual_net)
    train_one(want)
    got = fresh(models.residual_net)
    opt = torch.optim.SGD(got.parameters(), lr=0.05)
    pipe = gpipe.Pipeline(got, stages=4, chunks=4, schedule="1f1b")
    for x, y in data:
        pipe.step(x, y, F.mse_loss)
        opt.step()
        opt.zero_grad()
    assert_same_weights(got, want)
    assert pipe.captured is not None
    assert all(len(c) >= 2 for c in pipe.captured.crossing)  # the running value and the stem's, at every cut


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpt2_in_half_precision_equals_one_device_autocast_rounded_at_the_cuts(precision):
    """The reference runs the same pieces on one device under autocast, casting what crosses each stage's cut
    as the stages do; fp16 with a loss scale that never overflows here."""
    from gpipe.precision import DTYPES, LossScaler

    half = DTYPES[precision]
    assert half is not None
    data = batches(2, 8, 10)
    got = fresh(models.gpt2)
    _, pipe = pipelined(got, data, chunks=4, split_points=["transformer.h.2"], precision=precision)
    want = fresh(models.gpt2)
    pieces = capture(want, _cut(data[0][0], 8, 1, 4)[0], ["transformer.h.2"]).pieces
    cuts = {a for a, _ in pipe.bounds[1:]}
    opt = torch.optim.SGD(want.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=LossScaler.INIT, enabled=precision == "fp16")
    for x, y in data:
        for xs, ys in zip(_cut(x, 8, 1, 4), _cut(y, 8, 1, 4), strict=True):
            out = xs
            with torch.autocast("cpu", dtype=half):
                for i, piece in enumerate(pieces):
                    if i in cuts:
                        out = torch.utils._pytree.tree_map(
                            lambda t: t.to(half) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t,
                            out)
                    out = piece(out)
            scaler.scale(lm_loss(out.float(), ys) * ys.size(0) / 8).backward()
        scaler.step(opt)  # fp16: skipped when a gradient overflowed, as the stages skip it
        scaler.update()
        opt.zero_grad()
    assert_same_weights(got, want)
    assert got.transformer.wte.weight is got.lm_head.weight


def test_evaluation_is_the_models_eval_mode_output_dropout_off():
    model = fresh(models.gpt2, dropout=0.3)
    pipe = gpipe.Pipeline(model, stages=2, chunks=2)
    x = torch.randint(0, 97, (4, 10))
    with torch.no_grad():  # forward only, in eval mode (with gradients in training: the training forward)
        out = pipe({"input_ids": x})
    model.eval()
    assert torch.equal(out, model(input_ids=x).logits)


def test_a_copy_of_the_pieces_runs_as_they_do_and_warns_of_nothing():
    import copy
    import warnings

    c = capture(fresh(models.gpt2), {"input_ids": torch.zeros(2, 4, dtype=torch.long)}, ["transformer.h.2"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # copying a TreeSpec warned (FutureWarning) at every validate and run
        twin = copy.deepcopy(c.pieces)
    x = {"input_ids": torch.randint(0, 97, (3, 6))}
    assert torch.equal(twin(x), c.pieces(x))
    assert twin[0].transformer.wte.weight is not c.pieces[0].transformer.wte.weight


def test_a_split_point_that_names_no_submodule_lists_the_nearest_names():
    with pytest.raises(CaptureError, match=r"'transformer\.h\.9' names no submodule.*nearest: transformer\.h\.\d"):
        capture(fresh(models.gpt2), {"input_ids": torch.zeros(2, 4, dtype=torch.long)}, ["transformer.h.9"])


def test_a_model_that_branches_on_a_tensor_value_is_refused_with_what_to_do():
    with pytest.raises(CaptureError, match="torch.export cannot capture Branchy.*torch.cond"):
        capture(models.Branchy(), torch.randn(2, 8), ["blocks.1"])


def test_a_model_with_no_blocks_and_no_split_points_is_refused():
    with pytest.raises(CaptureError, match="no repeated blocks.*split_points"):
        capture(torch.nn.Linear(4, 4), torch.randn(2, 4))


def test_the_output_named_by_output_is_what_the_loss_takes():
    model = fresh(models.gpt2)
    c = capture(model, {"input_ids": torch.zeros(2, 4, dtype=torch.long)}, ["transformer.h.2"], output="logits")
    assert c.pieces({"input_ids": torch.ones(2, 4, dtype=torch.long)}).shape == (2, 4, 97)
    with pytest.raises(KeyError, match="no 'hidden'"):
        select_output({"logits": torch.zeros(1)}, "hidden")


def test_validate_says_what_crosses_each_cut_and_plan_json_each_stages_modules(tmp_path):
    from gpipe.coordinator.attempt.metrics import write_plan
    from tests.support.local import plan_of
    plan = plan_of(job(GPT2, model={"factory": "tests.support.models:llama", "split_points": ["model.layers.2"]},
                        data__factory="tests.support.models:masked_pairs", data__args={}))
    (cut,) = plan.cut_lines()
    assert cut.startswith("cut 1 (before model.layers.2): [B, T, 32] float32 from model.layers.1")
    assert "[B, 1, T, T] bool" in cut  # the attention mask, made once before the first block
    write_plan(tmp_path, plan, [{}] * 2)
    stages = json.loads((tmp_path / "plan.json").read_text())["stages"]
    assert stages[0]["modules"][:2] == ["model.embed_tokens", "model.rotary_emb"]
    assert stages[1]["modules"][-2:] == ["model.norm", "lm_head"] and stages[1]["receives"] == [cut]
    model = models.llama()
    assert sum(s["parameters"] for s in stages) == sum(p.numel() for p in model.parameters())


def test_a_resume_with_another_split_and_stage_count_gives_the_one_device_weights(tmp_path):
    from gpipe.coordinator.outputs import checkpoint
    from gpipe.worker.stage_server import StageServer
    from tests.support.local import drive, plan_of, worst

    first = job(GPT2, checkpoint_every=2)
    try:
        drive(plan_of({**first, "steps": 2}), tmp_path)
    finally:
        StageServer.close_all()
    ck = checkpoint.load(checkpoint.step_dir(checkpoint.folder(tmp_path), 2))
    held = ck.model_state()
    assert "transformer.h.2.attn.c_attn.weight" in held and "lm_head.weight" not in held  # the model's names
    holders = [j for j, sh in enumerate(ck.shards) for k in sh.entries if k == "optim/transformer.wte.weight/momentum_buffer"]
    assert holders == [0]  # the tied weight's optimizer state once too, by its first holder
    second = {**first, "model": {**first["model"], "split_points": ["transformer.h.1", "transformer.h.3"]}}  # 3 stages
    try:
        drive(plan_of(second), tmp_path, resume=ck)
    finally:
        StageServer.close_all()
    got = checkpoint.load(checkpoint.step_dir(checkpoint.folder(tmp_path), 4)).model_state()
    want = one_device_job(4)
    assert worst(got, {k: v for k, v in want.items() if k != "lm_head.weight"}) <= 1e-5


# -- the service's path: real processes over gloo ----------------------------------------------------------------





def test_captured_pieces_name_no_traced_dtype_or_device_and_run_on_the_device_they_are_moved_to():
    """Export writes the traced sample's dtype and device into the graph (checks, a factory's device=): the pieces
    hold no such check, and `to_device` moves every device they name with them (here to the meta device, which
    runs anything a device would, without data)."""
    from torch import fx

    from gpipe.capture.graph import to_device

    x = batches(1, 4, 10, mask=True)[0][0]
    pieces = capture(fresh(models.llama), x).pieces

    def named(t) -> list:
        return [n for p in pieces.modules() if isinstance(p, fx.GraphModule) for n in p.graph.nodes
                if any(isinstance(a, t) for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs)))]

    checks = [n for p in pieces.modules() if isinstance(p, fx.GraphModule) for n in p.graph.nodes
              if n.target is torch.ops.aten._assert_tensor_metadata.default]
    assert not checks
    assert named(torch.device)  # arange and friends name the CPU they were traced on
    pieces.to("meta")
    to_device(pieces, torch.device("meta"))
    assert all(d == torch.device("meta") for n in named(torch.device) for d in
               torch.utils._pytree.tree_leaves((n.args, n.kwargs)) if isinstance(d, torch.device))
    out = x if not isinstance(x, dict) else {k: v.to("meta") for k, v in x.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for piece in pieces:
            out = piece(out)
    assert out.device.type == "meta" and out.shape[:2] == x["input_ids"].shape


def test_two_threads_capturing_at_once_both_get_their_pieces_and_another_threads_stderr_goes_on(capfd):
    """A worker builds its two model chunks (interleaved-1f1b, zbv) on two threads: torch.export's tracing state
    is process-wide, so the captures take turns; and what a third thread writes to stderr meanwhile is kept."""
    import sys
    import threading

    x = batches(1, 4, 10)[0][0]["input_ids"]
    start = threading.Barrier(3)
    got: list = []
    done = threading.Event()

    def one() -> None:
        model = fresh(models.gpt2)
        start.wait(timeout=30)
        try:
            got.append(len(capture(model, x).pieces))
        except Exception as e:  # what a corrupted trace raises: an AssertionError, a RuntimeError
            got.append(e)

    def chatter() -> None:
        start.wait(timeout=30)
        n = 0
        while not done.is_set() or n < 3:
            print(f"still here {n}", file=sys.stderr, flush=True)
            n += 1
            done.wait(0.05)

    threads = [threading.Thread(target=one) for _ in range(2)] + [threading.Thread(target=chatter)]
    for t in threads:
        t.start()
    for t in threads[:2]:
        t.join(timeout=120)
    done.set()
    threads[2].join(timeout=10)
    assert got == [4, 4]
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("still here")]
    assert len(lines) >= 3 and lines == [f"still here {i}" for i in range(len(lines))]


@pytest.mark.parametrize("init", ["exact", "per_layer"])
def test_a_stage_builds_from_the_coordinator_s_capture_without_capturing_again(tmp_path, monkeypatch, capfd, init):
    """StageConfig.pieces: the plan's pieces of the model chunk, without weights; the stage's layers from them hold
    the plan's weights (exact) or the per-layer init of its own capture (per_layer), and run as the plan's pieces
    do. Pieces that do not load: the stage captures the model itself, and says so."""
    from gpipe import stage
    from gpipe.capture import skeleton
    from gpipe.coordinator.plan.configs import stage_config
    from gpipe.coordinator.plan.job import make_plan
    from gpipe.coordinator.spec.job import JobSpec

    hook = {"init_hook": "tests.support.models:hf_init"} if init == "per_layer" else {}
    spec = JobSpec.model_validate(job(GPT2, init=init, model__split_points=["transformer.h.1", "transformer.h.3"],
                                      **hook))
    plan = make_plan(spec, tmp_path)
    monkeypatch.setattr(stage, "_skeletons", {})
    monkeypatch.setattr(stage, "_captures", {})
    built = []

    def layers(k: int, cfg_changes: dict | None = None) -> torch.nn.Sequential:
        cfg = stage_config(plan, k, 0, "cpu", "", 0)
        for name, value in (cfg_changes or {}).items():
            setattr(cfg, name, value)
        return stage.build_layers(cfg, plan.stage_state(k) if init == "exact" else None, torch.device("cpu"))

    real_capture = skeleton.capture_pieces
    monkeypatch.setattr(skeleton, "capture_pieces", lambda *a: built.append(a) or real_capture(*a))
    stages = [layers(k) for k in range(3)]
    assert built == []  # no stage captured the model
    assert all(isinstance(plan.stage_pieces(k), bytes) for k in range(3))
    if init == "exact":
        x = torch.randint(0, 97, (3, 6))
        want, got = x, x
        for k, (start, end) in enumerate(plan.bounds):
            for i in range(start, end):
                want = plan.model[i](want)
            got = stages[k](got)
        assert torch.equal(got, want)
    else:  # as the stages of a job that sends no pieces (an older coordinator's) build them, capturing
        monkeypatch.setattr(stage, "_skeletons", {})
        monkeypatch.setattr(stage, "_captures", {})
        own = [layers(k, {"pieces": None}) for k in range(3)]
        assert len(built) == 1  # captured once in the process, for every stage
        for a, b in zip(stages, own, strict=True):
            assert a.state_dict().keys() == b.state_dict().keys()
            assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    built.clear()
    monkeypatch.setattr(stage, "_skeletons", {})
    monkeypatch.setattr(stage, "_captures", {})
    layers(1, {"pieces": b"not a pickle"})
    assert len(built) == 1 and "the coordinator's capture did not load here" in capfd.readouterr().err
