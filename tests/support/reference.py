"""One-device training with the same micro-batches: what every pipelined run must equal.

Plain torch only (the model, torch.optim, clip_grad_norm_), apart from the
documented per-layer seeding of randomness (gpipe.rng), which makes dropout
independent of where the model is cut.

Precision (the spec's `precision`): bf16 and fp16 run each micro-batch's forward
under torch.autocast, the loss in float32 (the output cast up, outside autocast);
fp16 scales the loss with torch.amp.GradScaler (unscale, clip, step or skip, update).
This is plain one-device autocast: it does not round the values at the cuts as the
pipeline does (gpipe.precision), which is why bf16 is compared to within 1e-3.
With `cuts` (the balance), it rounds the output of each stage's last layer there too, as
the pipeline does (skip connections that cross a cut are not rounded here: the tests'
are bf16 already).

BatchNorm: each micro-batch's forward runs once, in training mode, so it updates
the running statistics once per micro-batch. With `deferred_batch_norm`, the
running statistics are set back after the micro-batches, and BatchNorm's own
update runs once on the step's inputs of each layer, all micro-batches together.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import default_collate

from gpipe import Pipeline
from gpipe.factory import resolve
from gpipe.rng import seeded_forward
from gpipe.weight_init import per_layer

OPTIM = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def optimizer(opt_spec: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    """The spec's optimizer over `params`: sgd, adam, adamw by their fields, or a class by import path
    ('torch.optim:RMSprop', a module of the job's on sys.path) with lr and `args`."""
    opt_spec = dict(opt_spec)
    name = opt_spec.pop("name")
    opt_spec.pop("shard", None)  # one device: nothing to shard across
    if ":" in name:
        return resolve(name)(params, lr=opt_spec["lr"], **opt_spec.get("args", {}))
    if name == "adamw":
        opt_spec.setdefault("weight_decay", 0.01)
    return OPTIM[name](params, **opt_spec)


def train(spec: dict[str, Any], device: str = "cpu", cuts: list[int] | None = None,
          pipelined: bool = False, as_chunk: bool = False) -> dict[str, torch.Tensor]:
    """The weights (on the CPU) after training `spec` on `device`, one micro-batch after another.

    `cuts`, layers per stage: with bf16 or fp16, the float32 values between those stages are cast to the
    autocast dtype, as they are when they cross a cut. With `pipelined`, the same loop runs each step's
    forwards and backwards through gpipe.Pipeline cut at `cuts` (the spec's chunks, schedule, checkpointing,
    precision, deferred BatchNorm and replicas), as a user of the in-process API would. `as_chunk`: one
    device's micro-batches cut as torch.chunk cuts them, as gpipe.Pipeline does, rather than as the service does
    (micro_batches).
    """
    seed = spec.get("seed", 0)
    model = initial_model(spec).to(device)
    pipe = None
    if pipelined:
        s = spec.get("loss_scale", {})
        pipe = Pipeline(model, cuts or [len(model)], chunks=spec.get("chunks", 1),
                        schedule=spec.get("schedule", "gpipe"), virtual_stages=spec.get("virtual_stages", 1),
                        activation_checkpoint=spec.get("activation_checkpoint", "never"),
                        precision=spec.get("precision", "fp32"),
                        deferred_batch_norm=spec.get("deferred_batch_norm", False),
                        replicas=spec.get("replicas", 1), seed=seed,
                        loss_scale=(s.get("init", 2.0**16), s.get("growth_interval", 2000)), timeout_s=60,
                        deterministic=spec.get("deterministic", False),
                        devices=[device] * (len(cuts or [len(model)]) // spec.get("virtual_stages", 1)))
    half = HALF.get(spec.get("precision", "fp32"))
    scaler = None
    if spec.get("precision") == "fp16":
        s = spec.get("loss_scale", {})
        scaler = torch.amp.GradScaler(device, init_scale=s.get("init", 2.0**16),
                                      growth_interval=s.get("growth_interval", 2000))
    data = resolve(spec["data"]["factory"])(**spec["data"].get("args", {}))
    loss_fn = resolve(spec.get("loss", "cross_entropy"))
    opt = optimizer(spec["optimizer"], model.parameters())
    sched = None
    if spec.get("lr_schedule"):
        s = spec["lr_schedule"]
        if s["name"] == "step":
            sched = torch.optim.lr_scheduler.StepLR(opt, s["step_size"], s.get("gamma", 0.1))
        else:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_factor(spec, k))
    batch, chunks = spec["data"]["batch_size"], spec.get("chunks", 1)
    layers = list(enumerate(model))
    segments, start = [], 0
    for n in cuts or [len(layers)]:
        segments.append(layers[start : start + n])
        start += n
    model.train()
    for step in range(spec["steps"]):
        idx = [(step * batch + j) % len(data) for j in range(batch)]
        if spec["data"].get("shuffle"):
            # Epoch e visits the items in the order of randperm seeded by (seed, e).
            n = len(data)
            idx = [
                int(torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + p // n))[p % n])
                for p in range(step * batch, (step + 1) * batch)
            ]
        collate = resolve(spec["data"]["collate"]) if spec["data"].get("collate") else default_collate
        x, y = collate([data[i] for i in idx])
        x, y = to(x, device), to(y, device)
        opt.zero_grad()
        if pipe is not None:  # the user's loop: the pipeline's step, their clipping and optimizer
            pipe.step(x, y, loss_fn)
            if spec.get("clip_grad_norm"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip_grad_norm"])
            opt.step()  # a skipped fp16 step left no gradients: nothing changes
            if sched:
                sched.step()
            continue
        whole_batch = WholeBatchStatistics(model) if spec.get("deferred_batch_norm") else None
        cut = micro_batches(x, y, batch, chunks, spec.get("replicas", 1), as_chunk=as_chunk)
        for i, (xm, ym, size) in zip(numbers(batch, chunks, spec.get("replicas", 1), as_chunk), cut, strict=True):
            if half is None:
                out = seeded_forward(layers, xm, seed, step, i)
            else:
                out = xm
                with torch.autocast(torch.device(device).type, dtype=half):
                    for k, segment in enumerate(segments):
                        if k:  # a cut: float32 crosses it in the autocast dtype
                            out = out.to(half) if out.dtype == torch.float32 else out
                        out = seeded_forward(segment, out, seed, step, i)
                out = out.float()
            loss = loss_fn(out, ym) * (size / batch)
            (scaler.scale(loss) if scaler else loss).backward()
        if whole_batch:
            whole_batch.update()
        if scaler:
            scaler.unscale_(opt)
        if spec.get("clip_grad_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip_grad_norm"])
        if scaler:
            scaler.step(opt)  # skipped when a gradient holds inf or nan
            scaler.update()
        else:
            opt.step()
        if sched:
            sched.step()
    if pipe is not None:
        pipe.close()
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def lr_factor(spec: dict[str, Any], k: int) -> float:
    """The LR of step k over optimizer.lr, written out apart from gpipe.coordinator.attempt.lr for cosine, linear and wsd: a
    warmup from 0 over warmup_steps, then (cosine, linear) a fall over the steps left to min_lr at the last, or
    (wsd) optimizer.lr until the last round(steps x decay_fraction) steps, which fall to the floor at the last."""
    s, steps, lr = spec["lr_schedule"], spec["steps"], spec["optimizer"]["lr"]
    warmup = s.get("warmup_steps", 0)
    if k < warmup:
        return (k + 1) / warmup
    if s["name"] == "wsd":
        fraction = s.get("decay_fraction", 0.1)
        decay = max(1, round(steps * fraction)) if fraction > 0 else 0
        if k < steps - decay or not decay:
            return 1.0
        floor = s["min_lr"] / lr if s.get("min_lr") is not None else s.get("min_lr_ratio") or 0.0
        p = (k - (steps - decay) + 1) / decay
        left = {"linear": 1 - p, "sqrt": 1 - math.sqrt(p), "cosine": (1 + math.cos(math.pi * p)) / 2}
        return floor + (1 - floor) * left[s.get("decay_shape", "linear")]
    floor = s.get("min_lr", 0.0) / lr
    t = min(1.0, (k - warmup) / max(1, steps - warmup - 1))
    left = {"linear": 1 - t, "cosine": (1 + math.cos(math.pi * t)) / 2}
    return floor + (1 - floor) * left[s["name"]]


def to(batch: Any, device: str) -> Any:
    """Every tensor of `batch` on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, tuple | list):
        return type(batch)(to(v, device) for v in batch)
    if isinstance(batch, dict):
        return {k: to(v, device) for k, v in batch.items()}
    return batch


def initial_model(spec: dict[str, Any]) -> nn.Sequential:
    """The model with the spec's initial weights: seeded, then the factory (init exact), or
    gpipe.weight_init.per_layer (init per_layer)."""
    seed = spec.get("seed", 0)
    torch.manual_seed(seed)
    model = resolve(spec["model"]["factory"])(**spec["model"].get("args", {}))
    if spec.get("init") == "per_layer":
        hook = resolve(spec["init_hook"]) if spec.get("init_hook") else None
        per_layer(model, seed, hook)
    if spec["model"].get("weights"):  # model.weights: a safetensors file of the state dict
        from safetensors.torch import load_file

        model.load_state_dict(load_file(spec["model"]["weights"]))
    return model


class WholeBatchStatistics:
    """Keeps each BatchNorm's running statistics and its inputs; `update` runs BatchNorm's update once on them."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
        self.saved = [{k: b.clone() for k, b in m.named_buffers()} for m in self.layers]
        self.inputs: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self.hooks = [m.register_forward_pre_hook(lambda m, args, i=i: self.inputs[i].append(args[0].detach()))
                      for i, m in enumerate(self.layers)]

    @torch.no_grad()
    def update(self) -> None:
        for h in self.hooks:
            h.remove()
        for m, saved, inputs in zip(self.layers, self.saved, self.inputs, strict=True):
            for name, b in m.named_buffers():
                b.copy_(saved[name])
            m(torch.cat(inputs))  # training mode: one update with the whole batch's statistics


def micro_batches(x: Any, y: Any, batch: int, chunks: int, replicas: int = 1,
                  as_chunk: bool = False) -> list[tuple[Any, Any, int]]:
    """The step's (input, target, size) micro-batches in order: the batch cut into `replicas` contiguous
    shards, each into `chunks`; replica r's micro-batch i is number r*chunks+i. Each shard is cut as
    torch.tensor_split cuts it (the service's spec), or with `as_chunk` as torch.chunk does (gpipe.Pipeline,
    as torchgpipe: fewer micro-batches when they do not fill `chunks`)."""
    out = []
    for xs, ys, rows in zip(split(x, replicas), split(y, replicas), torch.tensor_split(torch.arange(batch), replicas),
                            strict=True):
        if as_chunk:
            sizes = [len(r) for r in torch.chunk(rows, chunks)]
            out += list(zip(split(xs, sizes), split(ys, sizes), sizes, strict=True))
        else:
            sizes = [len(r) for r in torch.tensor_split(rows, chunks)]
            out += list(zip(split(xs, chunks), split(ys, chunks), sizes, strict=True))
    return out


def numbers(batch: int, chunks: int, replicas: int = 1, as_chunk: bool = False) -> list[int]:
    """The numbers of micro_batches' micro-batches (their seeds): replica r's i-th is r*chunks+i."""
    out = []
    for r, rows in enumerate(torch.tensor_split(torch.arange(batch), replicas)):
        count = len(torch.chunk(rows, chunks)) if as_chunk else chunks
        out += [r * chunks + i for i in range(count)]
    return out


def split(batch: Any, chunks: int | list[int]) -> list[Any]:
    """Micro-batches: every tensor cut along dim 0 by torch.tensor_split (or, given sizes, torch.split), everything
    else copied."""
    count = len(chunks) if isinstance(chunks, list) else chunks
    if isinstance(batch, torch.Tensor):
        return list(torch.split(batch, chunks) if isinstance(chunks, list) else torch.tensor_split(batch, chunks))
    if isinstance(batch, tuple | list):
        return [type(batch)(parts) for parts in zip(*(split(v, chunks) for v in batch), strict=True)]
    if isinstance(batch, dict):
        cut = {k: split(v, chunks) for k, v in batch.items()}
        return [{k: cut[k][i] for k in batch} for i in range(count)]
    return [batch] * count


def evaluate(spec: dict[str, Any], state: dict[str, torch.Tensor],
             cuts: list[int] | None = None, pipelined: bool = False) -> tuple[float, int]:
    """One-device evaluation of the weights `state` on the spec's eval data, in eval mode, without gradients:
    the mean loss over the samples (each batch's loss times its size), and the sample count.

    Batch b is items b*B ... b*B+B-1 of the eval set in order (the last may be shorter); `batches` limits them.
    With bf16 or fp16 the forward runs under autocast, rounded at `cuts` as in `train`, the loss in float32.
    With `pipelined`, each batch goes through gpipe.Pipeline cut at `cuts` (the spec's chunks, precision and
    deferred BatchNorm), as a user of the in-process API evaluates.
    """
    model = resolve(spec["model"]["factory"])(**spec["model"].get("args", {}))
    model.load_state_dict(state)
    model.eval()
    pipe = None
    if pipelined:
        model.train()  # the pipeline evaluates in eval mode whatever the model's, and leaves the mode as it was
        pipe = Pipeline(model, cuts or [len(model)], chunks=spec.get("chunks", 1),
                        precision=spec.get("precision", "fp32"),
                        deferred_batch_norm=spec.get("deferred_batch_norm", False), timeout_s=60)
    e = spec["eval"]
    data = resolve(e["data"]["factory"])(**e["data"].get("args", {}))
    loss_fn = resolve(spec.get("loss", "cross_entropy"))
    collate = resolve(e["data"]["collate"]) if e["data"].get("collate") else default_collate
    size, n = e["data"]["batch_size"], len(data)
    total, samples = 0.0, 0
    with torch.no_grad():
        for b in range(e.get("batches") or -(-n // size)):
            items = [data[i] for i in range(b * size, min((b + 1) * size, n))]
            x, y = collate(items)
            out = pipe(x).float() if pipe is not None else _autocast_forward(spec, model, x, cuts)
            total += float(loss_fn(out, y)) * len(items)
            samples += len(items)
    if pipe is not None:
        pipe.close()
    return total / samples, samples


def _autocast_forward(spec: dict[str, Any], model: nn.Sequential, x: Any, cuts: list[int] | None) -> Any:
    """model(x), under the spec's autocast (float32 rounded to its dtype at `cuts`) and cast back to float32."""
    half = HALF.get(spec.get("precision", "fp32"))
    if half is None:
        return model(x)
    with torch.autocast("cpu", dtype=half):
        start = 0
        for k, n in enumerate(cuts or [len(model)]):
            if k and x.dtype == torch.float32:
                x = x.to(half)  # a cut: float32 crosses it in the autocast dtype
            x = model[start : start + n](x)
            start += n
    return x.float()
