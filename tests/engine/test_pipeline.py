"""gpipe.Pipeline, the pipeline in one process: the transparency matrix in seconds.

Every case trains the spec through gpipe.Pipeline (the service's stages, as
threads, linked in memory) and one device on the same micro-batches
(tests/support/reference.py), and compares every weight and buffer. The service runs
these stages in processes over c10d: tests/service/test_transparency.py and the
feature files keep one real-process case per feature.
"""

from __future__ import annotations

import copy
import itertools
import random
import threading

import pytest
import torch
from torch import nn

import gpipe
from gpipe import measured, schedule, skip
from gpipe.rng import seeded_forward
from gpipe.schedule import Action, build
from gpipe.topology import model_chunk
from tests.support import reference
from tests.support.spec import DELETE, TWO_STAGES, job

MLP = {"factory": "mlp", "args": {"width": 16, "depth": 5}}
DROPOUT = {"factory": "tests.support.models:mlp_dropout", "args": {"width": 16, "depth": 3}}  # 10 layers
REGRESSION = {"factory": "random_regression", "args": {"n": 50, "in_features": 16, "out_features": 16}}
SKIPS = {"factory": "tests.support.models:skip_mlp", "args": {"width": 16, "skip_width": 24}}
BN = {"factory": "tests.support.models:bn_net", "args": {"width": 8}}
PAIRS = {"factory": "tests.support.models:pair_mlp", "args": {"width": 16, "blocks": 4}}
MASKED = {"factory": "tests.support.models:masked_mlp", "args": {"width": 16, "blocks": 3}}
DICTS = {"factory": "tests.support.models:dict_items", "args": {"n": 40, "width": 16}}
SEQ = {"factory": "tests.support.models:seq_model", "args": {}}
SENTENCES = {"factory": "tests.support.models:sentences", "args": {}, "collate": "gpipe.builtins:pad_collate"}
BN_DATA = {"factory": "random_regression", "args": {"n": 40, "in_features": 8, "out_features": 8}, "batch_size": 10}
# TWO_STAGES in this process: no name, the stages by the balance, 3 steps.
PIPELINE = {"name": DELETE, "stages": DELETE, "steps": 3}




def compare(spec: dict, balance: list[int], tolerance: float = 1e-5) -> float:
    """Train `spec` pipelined at `balance` and on one device; every tensor agrees within `tolerance` (integer
    buffers exactly). Returns the largest difference."""
    got = reference.train(spec, cuts=balance, pipelined=True)
    # gpipe.Pipeline's micro-batches: the gpipe schedule's as torch.chunk cuts them, the others' as the service's
    want = reference.train(spec, cuts=balance, as_chunk=spec.get("schedule", "gpipe") == "gpipe")
    assert set(got) == set(want)
    if spec.get("replicas", 1) > 1 and "3.calls" in want:
        # A buffer that a forward updates, other than BatchNorm's, is replica 0's: it counted its own micro-batches.
        assert int(got.pop("3.calls")) * spec["replicas"] == int(want.pop("3.calls"))
    for k in want:
        if not want[k].is_floating_point():
            assert torch.equal(got[k], want[k]), k
    worst = max((got[k].double() - want[k].double()).abs().max().item() for k in want)
    assert worst <= tolerance, f"weights differ from one device by {worst}"
    return worst


BALANCES = [[10], [4, 6], [1, 8, 1], [3, 2, 2, 3]]


@pytest.mark.parametrize("balance", BALANCES, ids=lambda b: "-".join(map(str, b)))
@pytest.mark.parametrize("checkpointing", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_checkpointing_and_balance_equal_one_device(schedule, checkpointing, balance):
    """Dropout (seeded per layer), momentum, 4 micro-batches of 2."""
    compare(job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=4, schedule=schedule, activation_checkpoint=checkpointing), balance)


@pytest.mark.parametrize(("name", "spec", "balance"), [
    ("uneven-micro-batches-adam-clip", job(TWO_STAGES, PIPELINE, chunks=3, data={**REGRESSION, "batch_size": 10}, clip_grad_norm=0.5,
                                           optimizer={"name": "adam", "lr": 0.01}), [2, 1, 3]),
    ("micro-batches-of-one", job(TWO_STAGES, PIPELINE, chunks=8), [1, 5]),
    ("transformer-except_last-steplr", job(TWO_STAGES, PIPELINE,
        model={"factory": "tests.support.models:tiny_lm", "args": {}}, data={"factory": "tests.support.models:tokens", "args": {},
                                                                    "batch_size": 9},
        loss="cross_entropy", chunks=3, schedule="1f1b", activation_checkpoint="except_last",
        optimizer={"name": "sgd", "lr": 0.1}, lr_schedule={"name": "step", "step_size": 2, "gamma": 0.5}), [2, 2, 2]),
    ("skips-across-cuts-always", job(TWO_STAGES, PIPELINE, model=SKIPS, activation_checkpoint="always", schedule="1f1b"), [1, 2, 3]),
    ("skips-within-a-stage", job(TWO_STAGES, PIPELINE, model=SKIPS), [3, 3]),
    ("pairs-across-cuts", job(TWO_STAGES, PIPELINE, model={"factory": "tests.support.models:pair_mlp", "args": {}}, chunks=3,
                              activation_checkpoint="except_last"), [1, 2, 2, 1]),
    ("pairs-1f1b-always", job(TWO_STAGES, PIPELINE, model=PAIRS, chunks=3, schedule="1f1b", activation_checkpoint="always",
                              data={**REGRESSION, "batch_size": 10}), [2, 2, 2]),
    ("dict-mask-gpipe-always", job(TWO_STAGES, PIPELINE, model=MASKED, chunks=2, activation_checkpoint="always",
                                   data={**DICTS, "batch_size": 8}), [2, 1, 2]),
    ("varlen-gpipe", job(TWO_STAGES, PIPELINE, model=SEQ, chunks=3, steps=5, data={**SENTENCES, "batch_size": 7}, loss="cross_entropy"),
     [1, 2, 1]),
    ("skips-3stages-gpipe", job(TWO_STAGES, PIPELINE, model=SKIPS, chunks=3, data={**REGRESSION, "batch_size": 10}), [1, 2, 3]),
])
def test_models_and_settings_equal_one_device(name, spec, balance):
    compare(spec, balance)


@pytest.mark.parametrize("deferred", [False, True], ids=["per-micro-batch", "deferred"])
@pytest.mark.parametrize("checkpointing", ["never", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_batch_norm_equals_one_device(schedule, checkpointing, deferred):
    """Running statistics once per micro-batch (a recomputation updates nothing), or once a step."""
    spec = job(TWO_STAGES, PIPELINE, model=BN, data=BN_DATA, chunks=3, schedule=schedule, activation_checkpoint=checkpointing,
               deferred_batch_norm=deferred, optimizer={"name": "sgd", "lr": 0.1})
    compare(spec, [4, 5, 3])


@pytest.mark.parametrize(("name", "spec", "balance"), [
    ("2x2-dropout-clip", job(TWO_STAGES, PIPELINE, model=DROPOUT, replicas=2, clip_grad_norm=0.2), [5, 5]),
    ("2x3-odd-shards-1f1b-always", job(TWO_STAGES, PIPELINE, model=DROPOUT, replicas=2, chunks=2, data={**REGRESSION, "batch_size": 7},
                                       schedule="1f1b", activation_checkpoint="always"), [3, 4, 3]),
    ("3x1", job(TWO_STAGES, PIPELINE, replicas=3, chunks=1, data={**REGRESSION, "batch_size": 9}), [6]),
    ("2x3-skips", job(TWO_STAGES, PIPELINE, model=SKIPS, replicas=2), [1, 2, 3]),
    ("2x2-bf16", job(TWO_STAGES, PIPELINE, replicas=2, precision="bf16"), [3, 3]),
    ("2x2-deferred-batch-norm", job(TWO_STAGES, PIPELINE, model=BN, data=BN_DATA, replicas=2, chunks=2, deferred_batch_norm=True,
                                    optimizer={"name": "sgd", "lr": 0.1}), [6, 6]),
])
def test_replicas_equal_one_device(name, spec, balance):
    compare(spec, balance)


ZB_BALANCES = [[4, 6], [1, 8, 1], [3, 2, 2, 3]]


@pytest.mark.parametrize("balance", ZB_BALANCES, ids=lambda b: f"{len(b)}stages")
@pytest.mark.parametrize("per_stage", [1, 2, None], ids=["M=P", "M=2P", "M=5"])
@pytest.mark.parametrize("checkpointing", ["never", "except_last", "always"])
def test_zb_h1_equals_one_device(checkpointing, per_stage, balance):
    """The split backward (B, then W later) under zb-h1: dropout, momentum, uneven micro-batches (a batch of
    2M+1), for P in 2, 3, 4 and M in P, 2P and an odd count."""
    m = per_stage * len(balance) if per_stage else 5
    compare(job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=m, schedule="zb-h1", activation_checkpoint=checkpointing,
                data={**REGRESSION, "batch_size": 2 * m + 1}), balance)


@pytest.mark.parametrize(("name", "spec", "balance"), [
    ("skips-across-cuts-always", job(TWO_STAGES, PIPELINE, model=SKIPS, chunks=3, activation_checkpoint="always"), [1, 2, 3]),
    ("skips-within-a-stage", job(TWO_STAGES, PIPELINE, model=SKIPS), [3, 3]),
    ("pairs-except_last", job(TWO_STAGES, PIPELINE, model=PAIRS, chunks=3, activation_checkpoint="except_last",
                              data={**REGRESSION, "batch_size": 10}), [2, 2, 2]),
    ("dict-mask-always", job(TWO_STAGES, PIPELINE, model=MASKED, activation_checkpoint="always", data={**DICTS, "batch_size": 8}),
     [2, 1, 2]),
    ("transformer-steplr", job(TWO_STAGES, PIPELINE, model={"factory": "tests.support.models:tiny_lm", "args": {}}, loss="cross_entropy",
                               data={"factory": "tests.support.models:tokens", "args": {}, "batch_size": 9}, chunks=3,
                               optimizer={"name": "sgd", "lr": 0.1}), [2, 2, 2]),
    ("batch-norm-deferred-always", job(TWO_STAGES, PIPELINE, model=BN, data=BN_DATA, chunks=3, activation_checkpoint="always",
                                       deferred_batch_norm=True, optimizer={"name": "sgd", "lr": 0.1}), [4, 5, 3]),
    ("batch-norm-per-micro-batch", job(TWO_STAGES, PIPELINE, model=BN, data=BN_DATA, chunks=3, optimizer={"name": "sgd", "lr": 0.1}),
     [4, 5, 3]),
    ("replicas-2x3-odd-shards", job(TWO_STAGES, PIPELINE, model=DROPOUT, replicas=2, chunks=3, data={**REGRESSION, "batch_size": 13}),
     [3, 4, 3]),
    ("adam-clip", job(TWO_STAGES, PIPELINE, chunks=3, data={**REGRESSION, "batch_size": 10}, clip_grad_norm=0.5,
                      optimizer={"name": "adam", "lr": 0.01}), [2, 1, 3]),
    ("bf16", job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=4, precision="bf16"), [5, 5]),
    ("fp16", job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=4, precision="fp16"), [5, 5]),
])
def test_zb_h1_with_every_feature_equals_one_device(name, spec, balance):
    compare({**spec, "schedule": "zb-h1"}, balance)


def test_zb_h1_fp16_overflow_skips_the_step_as_grad_scaler_does():
    """The overflow is seen only once every W of the step has run: the check stays at the step's end."""
    spec = job(TWO_STAGES, PIPELINE, model={"factory": "tests.support.models:overflow_mlp", "args": {"width": 16, "at": [2]}}, precision="fp16",
               optimizer={"name": "adam", "lr": 0.01}, loss_scale={"init": 1024.0, "growth_interval": 2},
               schedule="zb-h1", chunks=3)
    compare(spec, [2, 2, 2])


@pytest.mark.parametrize(("stages", "chunks"), [(2, 8), (4, 4), (4, 8), (3, 5)])
def test_zb_h1_holds_at_most_a_tenth_more_activations_than_1f1b(stages, chunks):
    """The largest stage's counted activation peak (the stages' activation_peak_bytes): each stage keeps its
    micro-batches until their W, at most `stages` of them, as 1f1b's first stage does."""
    def peak(schedule: str) -> int:
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(2 * stages)])
        with gpipe.Pipeline(model, [2] * stages, chunks=chunks, schedule=schedule) as pipe:
            pipe.step(torch.randn(4 * chunks, 64), torch.randn(4 * chunks, 64), nn.functional.mse_loss)
            return max(r.activation_peak_bytes for r in pipe.results)

    assert peak("zb-h1") <= 1.1 * peak("1f1b")


# Model chunks (2 per worker) of the 10 layers, for 2, 3 and 4 workers.
INTERLEAVED_BALANCES = [[2, 3, 2, 3], [1, 2, 3, 1, 2, 1], [2, 1, 1, 1, 1, 2, 1, 1]]


@pytest.mark.parametrize("balance", INTERLEAVED_BALANCES, ids=lambda b: f"{len(b) // 2}workers")
@pytest.mark.parametrize("per_worker", [1, 2], ids=["M=P", "M=2P"])
@pytest.mark.parametrize("checkpointing", ["never", "except_last", "always"])
def test_interleaved_1f1b_equals_one_device(checkpointing, per_worker, balance):
    """Two model chunks per worker: dropout, momentum, uneven micro-batches (a batch of 2M+1)."""
    m = per_worker * len(balance) // 2
    compare(job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=m, schedule="interleaved-1f1b", virtual_stages=2,
                activation_checkpoint=checkpointing, data={**REGRESSION, "batch_size": 2 * m + 1}), balance)


@pytest.mark.parametrize(("name", "spec", "balance"), [
    ("skips-3-chunks-per-worker-always", job(TWO_STAGES, PIPELINE, model=SKIPS, activation_checkpoint="always", virtual_stages=3),
     [1, 1, 1, 1, 1, 1]),
    ("pairs-except_last", job(TWO_STAGES, PIPELINE, model=PAIRS, chunks=2, activation_checkpoint="except_last", virtual_stages=2,
                              data={**REGRESSION, "batch_size": 10}), [1, 2, 2, 1]),
    ("batch-norm-deferred-always", job(TWO_STAGES, PIPELINE, model=BN, data=BN_DATA, activation_checkpoint="always", virtual_stages=2,
                                       deferred_batch_norm=True, optimizer={"name": "sgd", "lr": 0.1}), [4, 2, 3, 3]),
    ("replicas-2x2", job(TWO_STAGES, PIPELINE, model=DROPOUT, replicas=2, virtual_stages=2, data={**REGRESSION, "batch_size": 13}),
     [3, 2, 2, 3]),
    ("bf16", job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=4, precision="bf16", virtual_stages=2), [2, 3, 2, 3]),
    ("fp16", job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=4, precision="fp16", virtual_stages=2), [2, 3, 2, 3]),
])
def test_interleaved_1f1b_with_every_feature_equals_one_device(name, spec, balance):
    compare({**spec, "schedule": "interleaved-1f1b"}, balance)


V_SCHEDULES = ["zbv", "v-half", "v-min", "dualpipev", "measured"]  # zbv's V: worker k holds model chunks k and 2P-1-k


def v_chunks(schedule: str, m: int, workers: int) -> int:
    """`m` micro-batches, or for dualpipev, which takes 2P or more, 2P+1 in place of fewer than 2P."""
    return 2 * workers + 1 if schedule == "dualpipev" and m < 2 * workers else m


@pytest.mark.parametrize("schedule", V_SCHEDULES)
@pytest.mark.parametrize("balance", INTERLEAVED_BALANCES, ids=lambda b: f"{len(b) // 2}workers")
@pytest.mark.parametrize("per_worker", [1, 2, None], ids=["M=P", "M=2P", "M=5"])
@pytest.mark.parametrize("checkpointing", ["never", "except_last", "always"])
def test_zbv_equals_one_device(checkpointing, per_worker, balance, schedule):
    """Worker k holds model chunks k and 2P-1-k, the backward split (zbv, and v-half, v-min and dualpipev in the
    same V): dropout, momentum, uneven micro-batches."""
    m = v_chunks(schedule, per_worker * len(balance) // 2 if per_worker else 5, len(balance) // 2)
    compare(job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=m, schedule=schedule, virtual_stages=2, activation_checkpoint=checkpointing,
                data={**REGRESSION, "batch_size": 2 * m + 1}), balance)


@pytest.mark.parametrize(("name", "spec", "balance"), [
    ("skips-always", job(TWO_STAGES, PIPELINE, model=SKIPS, chunks=3, activation_checkpoint="always"), [1, 1, 2, 2]),
    ("pairs-except_last", job(TWO_STAGES, PIPELINE, model=PAIRS, chunks=3, activation_checkpoint="except_last",
                              data={**REGRESSION, "batch_size": 10}), [1, 2, 2, 1]),
    ("batch-norm-deferred-always", job(TWO_STAGES, PIPELINE, model=BN, data=BN_DATA, chunks=3, activation_checkpoint="always",
                                       deferred_batch_norm=True, optimizer={"name": "sgd", "lr": 0.1}), [4, 2, 3, 3]),
    ("replicas-2x2", job(TWO_STAGES, PIPELINE, model=DROPOUT, replicas=2, chunks=3, data={**REGRESSION, "batch_size": 13}), [3, 2, 2, 3]),
    ("bf16", job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=4, precision="bf16"), [2, 3, 2, 3]),
    ("fp16", job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=4, precision="fp16"), [2, 3, 2, 3]),
])
@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_zbv_with_every_feature_equals_one_device(name, spec, balance, schedule):
    compare({**spec, "schedule": schedule, "virtual_stages": 2, "chunks": v_chunks(schedule, spec["chunks"], 2)}, balance)


def test_v_half_and_v_min_hold_fewer_activations_than_zbv():
    """Each worker's counted activation peak (activation_peak_bytes, a worker's model chunks' together), 4 workers
    and 8 micro-batches: the simulator's v-half holds 3/4 of zbv's model chunks, v-min 1/2 (on workers 1 to 3 the
    counted bytes are those shares; worker 0, holding the first and the last model chunks, saves less)."""
    def peaks(schedule: str) -> list[int]:
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(16)])
        with gpipe.Pipeline(model, [2] * 8, chunks=8, schedule=schedule, virtual_stages=2) as pipe:
            pipe.step(torch.randn(32, 64), torch.randn(32, 64), nn.functional.mse_loss)
            return [pipe.results[model_chunk(schedule, k, 0, 4)].activation_peak_bytes for k in range(4)]

    zbv, half, least = peaks("zbv"), peaks("v-half"), peaks("v-min")
    assert all(a < b < c for a, b, c in zip(least, half, zbv, strict=True))
    assert max(least) <= 0.8 * max(zbv) and max(half) <= 0.9 * max(zbv)


def measured_order(workers: int, m: int, virtual: int, seed: int) -> str:
    """gpipe.measured's order (a table's schedule name) for a random cost table of uneven model chunks, a random
    memory limit of two to four micro-batches a worker."""
    rng = random.Random(seed)
    g = workers * virtual
    costs = measured.Costs(*([rng.uniform(0.2, 3.0) for _ in range(g)] for _ in range(3)),
                           send=[rng.uniform(0.0, 0.5) for _ in range(g)], held=[1.0] * g)
    limits = [float(virtual * rng.randint(2, 4)) for _ in range(workers)]
    return measured.build(workers, m, virtual, costs.length(workers), costs.held_by(workers), limits).name


MEASURED_CASES = [([4, 6], 1, 4), ([1, 8, 1], 1, 5), ([3, 2, 2, 3], 1, 8), ([2, 3, 2, 3], 2, 4),
                  ([1, 2, 3, 1, 2, 1], 2, 5)]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("balance", "virtual", "m"), MEASURED_CASES, ids=lambda x: str(x).replace(" ", ""))
@pytest.mark.parametrize("checkpointing", ["never", "except_last", "always"])
def test_measured_orders_from_cost_tables_equal_one_device(checkpointing, balance, virtual, m, seed):
    """Orders built from uneven cost tables within memory limits (gpipe.measured), one model chunk a worker or
    the V: bit for bit, each model chunk's backwards and W's in micro-batch order as one device's."""
    order = measured_order(len(balance) // virtual, m, virtual, seed)
    worst = compare(job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=m, schedule=order, virtual_stages=virtual,
                        activation_checkpoint=checkpointing, data={**REGRESSION, "batch_size": 2 * m + 1}), balance,
                    tolerance=1e-6)
    assert worst == 0.0


@pytest.mark.parametrize("checkpointing", ["never", "always"])
def test_a_measured_v_order_of_whole_backwards_equals_one_device(checkpointing):
    """Where a whole backward costs less than its B and W apart, the V's order runs whole backwards (no W)."""
    rng = random.Random(0)
    costs = measured.Costs(*([rng.uniform(0.2, 3.0) for _ in range(4)] for _ in range(3)),
                           whole=[rng.uniform(0.2, 2.0) for _ in range(4)])
    order = measured.build(2, 4, 2, costs.length(2)).name
    assert "W" not in order
    worst = compare(job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=4, schedule=order, virtual_stages=2,
                        activation_checkpoint=checkpointing, data={**REGRESSION, "batch_size": 9}), [2, 3, 2, 3],
                    tolerance=1e-6)
    assert worst == 0.0


def test_a_table_whose_w_s_go_backwards_equals_one_device_within_1e_6():
    """A table read back with its W's in reverse micro-batch order: each weight's gradient summed in another
    order than one device's, so within 1e-6, not bit for bit."""
    rows = [[a for a in schedule.build("zb-h1", k, 3, 4) if a.kind != "W"] + [Action("W", i) for i in (3, 2, 1, 0)]
            for k in range(3)]
    order = schedule.table(measured.read_csv(measured.write_csv(rows)))
    compare(job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=4, schedule=order,
                data={**REGRESSION, "batch_size": 9}), [3, 4, 3], tolerance=1e-6)


@pytest.mark.parametrize(("name", "spec", "balance"), [
    ("skips-always", job(TWO_STAGES, PIPELINE, model=SKIPS, chunks=3, activation_checkpoint="always"), [1, 2, 3]),
    ("batch-norm-deferred", job(TWO_STAGES, PIPELINE, model=BN, data=BN_DATA, chunks=3, deferred_batch_norm=True,
                                optimizer={"name": "sgd", "lr": 0.1}), [4, 5, 3]),
    ("replicas-2x2", job(TWO_STAGES, PIPELINE, model=DROPOUT, replicas=2, chunks=3, data={**REGRESSION, "batch_size": 13}),
     [5, 5]),
    ("adam-clip", job(TWO_STAGES, PIPELINE, chunks=3, data={**REGRESSION, "batch_size": 10}, clip_grad_norm=0.5,
                      optimizer={"name": "adam", "lr": 0.01}), [2, 1, 3]),
    ("bf16", job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=4, precision="bf16"), [5, 5]),
    ("fp16", job(TWO_STAGES, PIPELINE, model=DROPOUT, chunks=4, precision="fp16"), [5, 5]),
])
def test_measured_with_every_feature_equals_one_device(name, spec, balance):
    """`measured` on one model chunk a worker (gpipe.Pipeline builds it at the cost model's lengths); the V's
    cases run with the other V schedules."""
    compare({**spec, "schedule": "measured"}, balance)


def test_interleaved_micro_batches_go_in_rounds_of_the_workers():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    with pytest.raises(ValueError, match="^chunks: .* 3 is not a multiple of 2"):
        gpipe.Pipeline(model, [1] * 4, chunks=3, schedule="interleaved-1f1b", virtual_stages=2)


def test_dualpipev_takes_two_rounds_of_micro_batches():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    with pytest.raises(ValueError, match="^chunks: dualpipev .* 4 or more, not 3"):
        gpipe.Pipeline(model, [1] * 4, chunks=3, schedule="dualpipev", virtual_stages=2)


@pytest.mark.parametrize(("schedule", "virtual"), [("interleaved-1f1b", 3)] + [(s, 2) for s in V_SCHEDULES])
def test_a_workers_chunks_run_one_action_at_a_time_in_the_schedules_order(schedule, virtual):
    """The stages of one worker's chunks take turns: together they run the worker's order, never two at once."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(2 * virtual)])
    with gpipe.Pipeline(model, [1] * 2 * virtual, chunks=4, schedule=schedule, virtual_stages=virtual) as pipe:
        pipe.step(torch.randn(8, 8), torch.randn(8, 8), nn.functional.mse_loss)
        for worker in range(2):
            stages = [pipe.results[model_chunk(schedule, worker, c, 2)] for c in range(virtual)]
            ran = sorted((s.start_unix + start, s.start_unix + end, kind, mb, chunk)
                         for chunk, s in enumerate(stages) for kind, mb, start, end in s.timeline)
            assert [repr(Action(kind, mb, chunk)) for _, _, kind, mb, chunk in ran] == \
                [repr(a) for a in build(schedule, worker, 2, 4, virtual)]
            # One at a time: the stages date their timelines on the process's one clock; a microsecond for the
            # rounding of those dates (seconds since 1970 in a double), far below any action's time.
            assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(ran))


@pytest.mark.parametrize(("name", "spec", "balance"), [
    ("2stages-gpipe", job(TWO_STAGES, PIPELINE), [3, 3]),
    ("3stages-1f1b-checkpoint", job(TWO_STAGES, PIPELINE, chunks=4, schedule="1f1b", activation_checkpoint="always"), [1, 2, 3]),
    ("2stages-1f1b-dropout", job(TWO_STAGES, PIPELINE, model=DROPOUT, schedule="1f1b"), [5, 5]),
    ("3stages-skips", job(TWO_STAGES, PIPELINE, model=SKIPS, activation_checkpoint="always"), [1, 2, 3]),
    ("3stages-gpipe-except_last-adam-clip", job(TWO_STAGES, PIPELINE, chunks=3, data={**REGRESSION, "batch_size": 9}, clip_grad_norm=0.5,
                                                activation_checkpoint="except_last",
                                                optimizer={"name": "adam", "lr": 0.01}), [2, 1, 3]),
])
def test_bf16_equals_one_device_autocast_rounded_at_the_cuts(name, spec, balance):
    compare({**spec, "precision": "bf16"}, balance)


@pytest.mark.parametrize("balance", [[3, 3], [2, 2, 2]], ids=["first-of-2", "middle-of-3"])
def test_fp16_overflow_on_one_stage_skips_the_step_as_grad_scaler_does(balance):
    """The overflow (step 1's first forward) is one stage's: every gradient is dropped, the scale halves, and
    the weights equal torch's GradScaler on one device."""
    spec = job(TWO_STAGES, PIPELINE, model={"factory": "tests.support.models:overflow_mlp", "args": {"width": 16, "at": [2]}}, precision="fp16",
               optimizer={"name": "adam", "lr": 0.01}, loss_scale={"init": 1024.0, "growth_interval": 2})
    compare(spec, balance)


def test_the_batch_loss_and_outputs_are_one_devices():
    """step() returns the sum of each micro-batch's loss times its share of the batch; pipe(x) is model(x) in eval
    mode, with the model's mode and buffers left as they were."""
    torch.manual_seed(0)
    model = reference.initial_model(job(TWO_STAGES, PIPELINE, model=BN))
    ref = copy.deepcopy(model)
    x, y = torch.randn(10, 8), torch.randn(10, 8)
    with gpipe.Pipeline(model, [3, 4, 5], chunks=3) as pipe:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():  # forward only (in training mode with gradients: the training forward)
            out = pipe(x)
        assert model.training
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        ref.eval()
        assert torch.allclose(out, ref(x), atol=1e-6)
        ref.train()
        loss = pipe.step(x, y, nn.functional.mse_loss)
    want = sum(nn.functional.mse_loss(seeded_forward(list(enumerate(ref)), xm, 0, 0, i), ym).item() * len(xm) / 10
               for i, (xm, ym) in enumerate(zip(torch.chunk(x, 3), torch.chunk(y, 3), strict=True)))
    assert abs(loss.item() - want) < 1e-6


def test_the_stages_hold_the_models_own_parameters():
    """An optimizer built over model.parameters() before the pipeline works unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    with gpipe.Pipeline(model, [2, 1], chunks=2) as pipe:
        pipe.step(torch.randn(4, 4), torch.randn(4, 1), nn.functional.mse_loss)
        assert all(p.grad is not None for p in params)
        before = [p.clone() for p in params]
        opt.step()
        assert all(not torch.equal(a, b) for a, b in zip(params, before, strict=True))
        assert [id(p) for p in model.parameters()] == [id(p) for p in params]


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("a bad layer")


def test_a_stage_that_raises_fails_the_step_at_once_and_the_pipeline_goes_on():
    """The error is the stage's own; the other stages stop waiting for it at once, not at the timeout."""
    gate = threading.Event()

    class Once(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not gate.is_set():
                gate.set()
                raise ValueError("a bad layer")
            return x

    model = nn.Sequential(nn.Linear(4, 4), Once(), nn.Linear(4, 4))
    with gpipe.Pipeline(model, [1, 1, 1], chunks=2, timeout_s=30) as pipe:
        with pytest.raises(ValueError, match="a bad layer"):
            pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)
        loss = pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)  # the next step runs
    assert loss.item() > 0


def test_a_stage_waits_no_longer_than_its_timeout_and_names_what_it_waited_for():
    stuck = threading.Event()

    class Stuck(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            stuck.wait(5)
            return x

    model = nn.Sequential(Stuck(), nn.Linear(4, 4))
    with gpipe.Pipeline(model, [1, 1], timeout_s=0.5) as pipe:
        with pytest.raises(TimeoutError, match="stage 0's activation of micro-batch 0"):
            pipe.step(torch.randn(2, 4), torch.randn(2, 4), nn.functional.mse_loss)
        stuck.set()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"balance": [2, 2]}, "balance"), ({"balance": [0, 3]}, "balance"), ({"chunks": 0}, "chunks"),
    ({"schedule": "zb"}, "schedule"), ({"activation_checkpoint": "sometimes"}, "activation_checkpoint"),
    ({"precision": "fp8"}, "precision"), ({"devices": ["cpu"]}, "devices"), ({"replicas": 0}, "replicas"),
    ({"virtual_stages": 2}, "virtual_stages"), ({"virtual_stages": 0}, "virtual_stages"),
    ({"schedule": "interleaved-1f1b", "virtual_stages": 3}, "balance"),
    ({"schedule": "zbv", "virtual_stages": 1}, "virtual_stages"),
    ({"schedule": "interleaved-1f1b"}, "virtual_stages"), ({"schedule": "interleaved-1f1b", "virtual_stages": 1}, "virtual_stages"),
])
def test_bad_arguments_are_named(kwargs, field):
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=f"^{field}:"):
        gpipe.Pipeline(model, **{"balance": [1, 2], **kwargs})


def test_batch_norm_with_replicas_and_no_deferral_is_refused_naming_the_layer():
    """Per micro-batch running statistics cannot equal one device across replicas."""
    model = reference.initial_model(job(TWO_STAGES, PIPELINE, model=BN))
    with pytest.raises(ValueError, match="^deferred_batch_norm: .*layer 1"):
        gpipe.Pipeline(model, [6, 6], replicas=2)


def test_a_batch_the_schedule_cannot_cut_is_named():
    """A schedule other than gpipe runs exactly `chunks` micro-batches: a smaller batch is named; so is a batch
    the replicas cannot share."""
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    with gpipe.Pipeline(model, [1] * 4, chunks=4, schedule="1f1b") as pipe, \
            pytest.raises(ValueError, match="^inputs: a batch of 3 cannot be cut into 4"):
        pipe.step(torch.randn(3, 2), torch.randn(3, 2), nn.functional.mse_loss)
    with gpipe.Pipeline(nn.Sequential(nn.Linear(2, 2)), [1], chunks=2, replicas=2) as pipe, \
            pytest.raises(ValueError, match="^inputs: a batch of 1 cannot be shared by 2 replicas"):
        pipe.step(torch.randn(1, 2), torch.randn(1, 2), nn.functional.mse_loss)


def test_the_shared_generators_seed_only_the_layers_that_draw():
    """Threads share the default generator: the layers that draw random numbers take its lock, the rest do not."""
    from gpipe.rng import SharedGenerators

    shared = SharedGenerators()
    assert shared.draws(nn.Dropout(0.1)) and shared.draws(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
    assert shared.draws(nn.TransformerEncoderLayer(8, 2, 16))
    assert not shared.draws(nn.Linear(2, 2)) and not shared.draws(nn.MultiheadAttention(8, 2))
    marked = nn.Linear(2, 2)
    marked.gpipe_random = True  # type: ignore[assignment]
    assert shared.draws(marked)


def test_skips_are_routed_between_the_stages_that_stash_and_pop():
    class Stash(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            skip.stash("x", x)
            return x * 2

    class Pop(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + skip.pop("x")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Stash(), nn.Linear(3, 3), nn.Tanh(), Pop(), nn.Linear(3, 3))
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 3), torch.randn(6, 3)
    for balance in ([2, 2, 2], [1, 4, 1], [6]):
        m = copy.deepcopy(model)
        with gpipe.Pipeline(m, balance, chunks=3) as pipe:
            pipe.step(x, y, nn.functional.mse_loss)
        ref.zero_grad()
        with skip.use(skip.Context()):
            for xm, ym in zip(torch.tensor_split(x, 3), torch.tensor_split(y, 3), strict=True):
                (nn.functional.mse_loss(ref(xm), ym) * len(xm) / 6).backward()
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), balance
