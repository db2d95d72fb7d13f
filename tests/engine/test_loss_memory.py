"""The loss's own memory in the memory model (gpipe.memory.footprint.Loss, gpipe.memory.model), against what a stage
makes, counted in process: torch's own tensors (gpipe.memory.meter.Made), not a process's resident memory.

A language model's last stage holds, for a while, far more than what its layers save: its logits beside their
log-softmax while the loss runs, then the log-softmax's gradient and the logits' at its backward; a checkpointed
micro-batch keeps the logits' gradient from its F to its B. On a wide vocabulary these are most of the stage's
peak (docs/memory.md: a GPT-2 token job's last worker was predicted 45% under its peak without them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpipe import losses, schedule
from gpipe.coordinator.plan import prediction
from gpipe.memory import footprint
from gpipe.memory.footprint import LossLines
from gpipe.memory.meter import Made
from gpipe.memory.model import Prediction, Setting, checkpointing, predict
from tests.support.local import attempt_secret, built, plan_of, run  # noqa: F401  # attempt_secret: autouse
from tests.support.spec import ONE_STAGE, job

VOCAB = 6000  # a micro-batch of 4 x 12 tokens: logits of 1.1 MiB; the embedding and the head 0.4 MiB each

LM = {"model": {"factory": "tests.support.models:tiny_lm", "args": {"vocab": VOCAB, "d_model": 16, "layers": 1,
                                                                    "dropout": 0.0}},
      "data": {"factory": "tests.support.models:tokens", "args": {"n": 32, "seq": 12, "vocab": VOCAB},
               "batch_size": 16},
      "loss": "cross_entropy", "chunks": 4, "clip_grad_norm": None}


def test_the_loss_figures_of_a_cross_entropy_are_its_log_softmax_and_two_gradients():
    """On logits of L bytes (a head's output, saved by nothing): the forward makes their log-softmax (L) and keeps
    it; the logits are alive beside it; the backward makes the log-softmax's gradient and the logits' (2 L), and
    leaves the logits' (L)."""
    head = nn.Sequential(nn.Linear(16, VOCAB))
    x = torch.randn(4, 12, 16)
    target = torch.randint(0, VOCAB, (4, 12))
    layers = footprint.measure_layers(head, x, target, losses.cross_entropy)
    logits = 4 * 12 * VOCAB * 4
    got = layers.loss
    assert got is not None
    scalar = 4  # the loss itself
    assert (got.output, got.whole, got.grad) == (logits, logits, logits)
    assert got.forward == got.keeps and logits <= got.keeps <= logits + 2 * scalar
    assert 2 * logits <= got.backward <= 2 * logits + 2 * scalar


def test_a_loss_that_saves_the_output_holds_it_once():
    """mse saves its input: the output is in what the stage holds already, and is not counted again."""
    layers = footprint.measure_layers(nn.Sequential(nn.Linear(8, 64)), torch.randn(32, 8), torch.randn(32, 64),
                                      F.mse_loss)
    assert layers.loss is not None
    assert layers.loss.output == 0 and layers.loss.whole == 32 * 64 * 4


def made_in(fn) -> int:  # type: ignore[no-untyped-def]
    """The most bytes torch had made at once while `fn` ran (what existed before it counts not)."""
    made = Made()
    with made:
        fn()
    return made.peak


def predicted(plan, loss: bool = True) -> Prediction:  # type: ignore[no-untyped-def]
    """The one worker's prediction (gpipe.coordinator.plan.prediction), with or without the loss's memory."""
    fp = plan.footprint
    chunk = prediction.chunk_memory(plan, fp, 0)
    if not loss:
        chunk = dataclasses.replace(chunk, loss=LossLines())
    spec = plan.spec
    sizes = plan.stream().micro_batches(0)[2]
    actions = schedule.build(spec.schedule, 0, 1, len(sizes))
    return predict(actions, [chunk], Setting(False, checkpointing(spec.activation_checkpoint, len(sizes)), sizes,
                                             plan.state_slots, eval_sizes=sizes))


def step_part(p: Prediction) -> int:
    """What a step makes of the prediction: the gradients and the activations (at the optimizer step, its buffers
    but the data, which exist before the step)."""
    return p.parts["grads"] + p.parts["activations"]


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ckpt", ["never", "except_last", "always"])
def test_the_predicted_peak_of_a_step_is_what_the_stage_makes_with_the_loss_and_far_under_without(schedule_name,
                                                                                                     ckpt):
    """A one-stage language model, its step after the first (the optimizer's state made): the most torch has made
    at once during the step, against the prediction's gradients and activations, within 10%; without the loss's
    memory the prediction is far under (each checkpointing's terms: the F's logits and log-softmax, the B's two
    gradients, a checkpointed micro-batch's kept gradient and its F's loss and backward at once)."""
    plan = plan_of(job(ONE_STAGE, LM, schedule=schedule_name, activation_checkpoint=ckpt))
    with built(plan, plan.stage_state(0)) as stage:
        run(stage, plan, range(1))
        measured = made_in(lambda: run(stage, plan, range(1, 2)))
    with_loss, without = predicted(plan), predicted(plan, loss=False)
    assert with_loss.moment != "the optimizer step", with_loss
    ratio = step_part(with_loss) / measured
    print(f"{schedule_name} {ckpt}: measured {measured} bytes, predicted {step_part(with_loss)} ({ratio:.3f}) at "
          f"{with_loss.moment}; without the loss {step_part(without)} ({step_part(without) / measured:.3f})")
    assert 0.9 <= ratio <= 1.1
    assert step_part(without) / measured < 0.75


def test_the_predicted_evaluation_is_what_the_last_stage_makes_in_an_eval_batch():
    """An eval batch after a step: its forwards one at a time, without autograd; the last stage makes the logits
    and their log-softmax at once. The prediction's evaluation part against the most torch made, within 10%."""
    plan = plan_of(job(ONE_STAGE, LM))
    xs, ys, sizes = plan.stream().micro_batches(0)
    with built(plan, plan.stage_state(0)) as stage:
        run(stage, plan, range(1))
        measured = made_in(lambda: stage.evaluate(0, xs, ys, sizes))
    chunk = prediction.chunk_memory(plan, plan.footprint, 0)
    want = chunk.inputs.at(max(sizes)) + chunk.loss.eval.at(max(sizes))
    print(f"eval: measured {measured} bytes, predicted {want} ({want / measured:.3f})")
    assert 0.9 <= want / measured <= 1.1
