"""The memory model's arithmetic (gpipe.memory.model) and the footprint it reads (gpipe.memory.footprint), in process:
micro-batches in flight as the schedules' actions hold them, checkpointing, the split backward, the optimizer's
state (sharded or not), and activation bytes counted exactly on small models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe import schedule, skip
from gpipe.builtins import mlp
from gpipe.memory import footprint
from gpipe.memory.footprint import Line
from gpipe.memory.model import ChunkMemory, Setting, in_flight, predict, walk
from gpipe.schedule import Action

PLAIN = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)]
VIRTUAL = [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zbv", 2)]


def brute_force(actions: list[Action], split: bool) -> int:
    """Micro-batches held, counted the long way: after each action, those forwarded and not yet through their
    backward (their W when split)."""
    end = "W" if split else "B"
    most = 0
    for n in range(len(actions) + 1):
        done = actions[:n]
        forwarded = {(a.worker_chunk, a.micro_batch) for a in done if a.kind == "F"}
        freed = {(a.worker_chunk, a.micro_batch) for a in done if a.kind == end}
        most = max(most, len(forwarded - freed))
    return most


@pytest.mark.parametrize(("name", "virtual"), PLAIN + VIRTUAL)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("chunks", [1, 2, 4, 5, 8])
def test_in_flight_is_the_schedules_own_count(name, virtual, stages, chunks):
    if name == "interleaved-1f1b" and chunks % stages:
        pytest.skip("interleaved-1f1b takes micro-batches in rounds of the workers")
    sim = schedule.simulate(name, stages, chunks, virtual)
    for k in range(stages):
        actions = schedule.build(name, k, stages, chunks, virtual)
        split = schedule.splits_backward(actions)
        assert in_flight(actions, split) == brute_force(actions, split) == sim.max_in_flight[k]


def chunk(held: int = 100, kept: int = 40, inputs: int = 10, trainable: int = 1000, params: int = 1000,
          outputs: int = 0, heaped: int | None = None) -> ChunkMemory:
    """A model chunk whose figures do not grow with the micro-batch (its gradients all made in the heap unless
    `heaped` says how many bytes are)."""
    return ChunkMemory(params, trainable, trainable, Line(held), Line(kept), Line(inputs), Line(outputs),
                       trainable if heaped is None else heaped)


def setting(split: bool = False, ckpt: bool = False, chunks: int = 4, **kw) -> Setting:
    return Setting(split, lambda _: ckpt, [1] * chunks, **kw)


def test_gpipe_peaks_before_its_first_backward_with_every_micro_batch_and_no_gradient():
    actions = schedule.build("gpipe", 0, 2, 4)
    m = walk(actions, [chunk(trainable=50)], setting())
    assert (m.activations, m.grads, m.what) == (400, 0, "after F3")


def test_1f1b_holds_the_stages_left_then_the_gradients_too():
    actions = schedule.build("1f1b", 0, 2, 4)  # F0 F1 B0 F2 B1 F3 B2 B3
    m = walk(actions, [chunk(trainable=50)], setting())
    assert (m.activations, m.grads) == (200, 50)  # after F2: two held, gradients since B0


def test_checkpointing_keeps_inputs_and_recomputes_one_micro_batch():
    actions = schedule.build("gpipe", 0, 2, 4)
    m = walk(actions, [chunk(trainable=0)], setting(ckpt=True))
    # During B3: four inputs, and micro-batch 3's forward recomputed whole in place of its input.
    assert (m.activations, m.what) == (3 * 10 + 100, "during B3")


def test_the_split_backward_keeps_what_w_needs_until_w():
    actions = schedule.build("zb-h1", 1, 2, 4)
    m = walk(actions, [chunk(held=100, kept=40, trainable=0)], setting(split=True))
    # Stage 1 of 2: F0 B0 F1 B1 W0 ...: after F1, micro-batch 0 holds its kept 40, micro-batch 1 its 100.
    assert m.activations == 140


def test_sharding_keeps_one_replicas_share_of_the_optimizer_state():
    actions = schedule.build("1f1b", 0, 2, 4)
    whole = predict(actions, [chunk(trainable=4000)], setting(state_slots=2, replicas=2))
    part = predict(actions, [chunk(trainable=4000)], setting(state_slots=2, replicas=2, shard=True))
    four = predict(actions, [chunk(trainable=4000)], setting(state_slots=2, replicas=4, shard=True))
    assert whole.parts["optimizer"] == 2 * 4000
    assert part.parts["optimizer"] == 2 * 4000 // 2
    assert four.parts["optimizer"] == 2 * 4000 // 4
    sgd = predict(actions, [chunk(trainable=4000)], setting(state_slots=0, replicas=2, shard=True))
    assert sgd.parts["optimizer"] == 0


def test_the_optimizer_steps_buffers_are_adams_two_temporaries_or_sharded_a_slices_and_a_gather_rounds():
    """At the optimizer step (a chunk of 4 weights of 64 MiB, AdamW, 2 replicas, on a CPU): unsharded, adam's
    denominator makes two temporaries of the largest weight at once; sharded, a slice's two
    (gpipe.memory.zero.SLICE_BYTES) and a gather round's (what it sends, receives, and c10d's flat copy), so the
    most is the replicas' gradient bucket, here one weight, or the last backward's gradient of one weight."""
    from gpipe.memory import zero

    big = 64 << 20
    c = ChunkMemory(4 * big, 4 * big, big, Line(1), Line(1), Line(1), Line(0))
    actions = schedule.build("1f1b", 1, 2, 2)
    plain = predict(actions, [c], setting(chunks=2, state_slots=2, replicas=2))
    sharded = predict(actions, [c], setting(chunks=2, state_slots=2, replicas=2, shard=True))
    assert plain.moment == sharded.moment == "the optimizer step"
    ahead = 1  # the next micro-batch's input
    assert plain.parts["buffers"] - ahead == 2 * big
    assert sharded.parts["buffers"] - ahead == big
    assert plain.parts["optimizer"] - sharded.parts["optimizer"] == 4 * big
    small = ChunkMemory(4 << 20, 4 << 20, 1 << 20, Line(1), Line(1), Line(1), Line(0))  # less than a bucket
    sharded = predict(actions, [small], setting(chunks=2, state_slots=2, replicas=2, shard=True))
    assert sharded.parts["buffers"] - ahead == max(4 << 20, 2 * zero.GATHER_BYTES + zero.GATHER_BYTES // 2)


def test_a_prediction_is_the_sum_of_its_parts():
    actions = schedule.build("zbv", 0, 2, 4, 2)
    p = predict(actions, [chunk(), chunk(held=300)], setting(split=True, state_slots=2, baseline=7, data=3))
    assert p.peak == sum(p.parts.values())
    assert p.parts["params"] == 2000 and p.parts["optimizer"] == 4000 and p.parts["baseline"] == 7
    assert p.parts["buffers"] >= 2 * 3  # two steps' data


def test_a_step_of_large_gradients_and_few_activations_peaks_at_the_optimizer_step():
    actions = schedule.build("1f1b", 1, 2, 2)
    p = predict(actions, [chunk(held=1, trainable=10**6)], setting(chunks=2, state_slots=2))
    assert p.moment == "the optimizer step"
    assert p.parts["grads"] == 10**6 and p.parts["activations"] == 0


# -- gpipe.memory.footprint ---------------------------------------------------------------------------------------


def test_footprint_counts_what_each_layer_saves_exactly():
    model = mlp(width=8, depth=2)  # (Linear, ReLU), (Linear, ReLU), Linear
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    m = footprint.measure_layers(model, x, y, nn.functional.mse_loss)
    act = 6 * 8 * 4  # one [6, 8] float32 tensor
    # Linear saves its input, ReLU its output; the next Linear's input is that output: one storage.
    assert sum(m.saved[0].values()) == 2 * act
    assert m.held(0, 1) == 2 * act  # input (saved by the Linear) + ReLU's output (saved, and sent on)
    assert m.held(0, 2) == 3 * act  # one more ReLU output; layer 1's Linear saves layer 0's
    # Layer 1's input and ReLU output; mse's saved input (the head's output) and target, and its loss (a scalar
    # viewing the buffer it reduced: 6 x 8 floats).
    assert m.held(1, 3) == 5 * act
    assert m.input_bytes(1) == act and m.output_bytes(2) == act
    assert all(p.grad is None for p in model.parameters())


def test_footprint_lines_give_any_micro_batch_size():
    model = mlp(width=16, depth=3)
    x, y = torch.randn(11, 16), torch.randn(11, 16)
    fp = footprint.measure(model, x, y, nn.functional.mse_loss)
    exact = footprint.measure_layers(model, x, y, nn.functional.mse_loss)
    for start, end in [(0, 2), (2, 4), (1, 4)]:
        assert fp.line(lambda m, s=start, e=end: m.held(s, e)).at(11) == exact.held(start, end)
        assert fp.line(lambda m, s=start, e=end: m.kept_for_weights(s, e)).at(11) == \
            exact.kept_for_weights(start, end)


def test_footprint_split_backward_keeps_less_but_the_first_stage_keeps_all():
    model = mlp(width=16, depth=3)
    m = footprint.measure_layers(model, torch.randn(4, 16), torch.randn(4, 16), nn.functional.mse_loss)
    assert m.kept_for_weights(0, 2) == m.held(0, 2)  # its input wants no gradient: B does nothing
    assert 0 < m.kept_for_weights(2, 4) < m.held(2, 4)  # the ReLU masks go at B; the Linears' inputs stay


def test_footprint_leaves_the_model_as_it_was():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()
    footprint.measure(model, x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_footprint_on_the_meta_device_counts_the_layers_as_in_memory():
    real = mlp(width=8, depth=2)
    with torch.device("meta"):
        meta = mlp(width=8, depth=2)
    x = torch.randn(4, 8)
    a = footprint.measure_layers(real, x)
    b = footprint.measure_layers(meta, x.to("meta"))
    assert [a.held(0, k) for k in (1, 2, 3)] == [b.held(0, k) for k in (1, 2, 3)]
    assert [a.kept_for_weights(1, k) for k in (2, 3)] == [b.kept_for_weights(1, k) for k in (2, 3)]


def test_the_cpu_heap_keeps_a_multiple_of_the_gradients_per_thread_that_runs_the_actions():
    one = predict(schedule.build("1f1b", 0, 2, 4), [chunk(trainable=100)], setting(heap_slack=3.0))
    two = predict(schedule.build("zbv", 0, 2, 4, 2), [chunk(trainable=100)] * 2, setting(split=True, heap_slack=3.0))
    cuda = predict(schedule.build("1f1b", 0, 2, 4), [chunk(trainable=100)], setting())
    # Two model chunks: twice the gradients, each kept by either chunk's thread.
    assert (one.parts["allocator"], two.parts["allocator"], cuda.parts["allocator"]) == (300, 3 * 200 * 2, 0)
    # Only the gradients made anew in the heap each micro-batch (not those computed into .grad).
    part = predict(schedule.build("1f1b", 0, 2, 4), [chunk(trainable=100, heaped=30)], setting(heap_slack=3.0))
    assert part.parts["allocator"] == 90 and part.parts["grads"] == one.parts["grads"]


class _Stash(nn.Module):
    def forward(self, x):
        skip.stash("s", x * 2)
        return x + 1


class _Pop(nn.Module):
    def forward(self, x):
        return x * skip.pop("s")  # saves both


def test_footprint_takes_skip_connections_as_the_popping_stage_receives_them():
    model = nn.Sequential(nn.Linear(8, 8), _Stash(), nn.Linear(8, 8), _Pop())
    m = footprint.measure_layers(model, torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss)
    act = 4 * 8 * 4
    assert len(m.saved[3]) >= 2 and act in m.saved[3].values()  # its input and the popped tensor (and mse's)
    assert all(p.grad is None for p in model.parameters())
