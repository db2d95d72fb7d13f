"""torchgpipe's GPipe module, over gpipe.Pipeline: its checks, attributes and container behaviour.

    model = GPipe(nn.Sequential(a, b, c, d), balance=[2, 2], devices=["cuda:0", "cuda:1"], chunks=8)
    output = model(input)             # training: every micro-batch forward
    loss_fn(output, target).backward()  # every micro-batch backward, through every partition

GPipe holds the module's own layers in `partitions` (an nn.ModuleList of
nn.Sequential, one per device, moved there when it is built) and runs them
with one gpipe.Pipeline over an nn.Sequential of the same layers, built at
the first forward: the same stages, schedule, checkpointing, skips and
randomness as gpipe's own. `model.train()` and `model.eval()` set the
layers' modes, as on torchgpipe; the flag of that nn.Sequential, the one the
Pipeline reads, says only whether it runs its forward with autograd (with
gradients enabled, or in training mode) or forward only (under
torch.no_grad() in eval mode). docs/torchgpipe.md lists what maps to what and
every difference that remains.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from gpipe.options import CHECKPOINTS
from gpipe.pipeline import Pipeline
from gpipe.torchgpipe.batchnorm import DeferredBatchNorm
from gpipe.torchgpipe.skip import verify_skippables

__all__ = ["GPipe"]

Device = torch.device | int | str


def recommend_auto_balance(message: str) -> str:
    """`message`, with where to get a balance from."""
    return (f"{message}\n\nA balance per partition can be measured (gpipe.torchgpipe.balance):\n\n"
            "  from gpipe.torchgpipe.balance import balance_by_time\n"
            "  balance = balance_by_time(partitions, model, sample)\n"
            "  model = GPipe(model, balance, ...)\n")


def verify_module(module: nn.Sequential) -> None:
    """TypeError unless `module` is an nn.Sequential; ValueError when a child appears twice in it or two
    children share a parameter (GPipe places each child, and each parameter, on one device)."""
    if not isinstance(module, nn.Sequential):
        raise TypeError("module must be nn.Sequential to be partitioned")
    if len(list(module.named_children())) != len(module):
        raise ValueError("module with duplicate children is not supported")
    if len(list(module.parameters())) != sum(len(list(child.parameters())) for child in module.children()):
        raise ValueError("module with duplicate parameters in distinct children is not supported")


def _moving_denied() -> TypeError:
    return TypeError("denied to move parameters and buffers, because GPipe should manage device placement")


def _check_tensors(value: Any, what: str) -> None:
    """TypeError unless `value` is a tensor or a tuple of tensors (torchgpipe's input and output)."""
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, tuple) and value and all(isinstance(t, torch.Tensor) for t in value):
        return
    got = type(value).__name__ if not isinstance(value, tuple) else \
        f"a tuple of {', '.join(type(t).__name__ for t in value) or 'nothing'}"
    raise TypeError(f"{what}: expected Tensor or Tuple[Tensor, ...], but got {got}")


class GPipe(nn.Module):
    """`module` (an nn.Sequential) cut into partitions of `balance` layers, each on its device of `devices`,
    each mini-batch cut into `chunks` micro-batches and pipelined through them (gpipe.Pipeline).

    devices: one per partition, those beyond the partitions dropped (default: every CUDA device; on a
    machine without one, the CPU for each partition). checkpoint: which micro-batches recompute their
    forward in the backward, 'always', 'except_last' (all but the last) or 'never'. deferred_batch_norm:
    the BatchNorms become DeferredBatchNorm of `chunks` (running statistics of the mini-batch).

    TypeError: `module` is not an nn.Sequential, or a skippable's stash and pop do not pair up
    (gpipe.torchgpipe.skip.verify_skippables). ValueError: no balance, a balance that does not cut `module`,
    chunks below 1, an unknown checkpoint, a child used twice or a parameter shared by two children.
    IndexError: fewer devices than partitions.
    """

    balance: list[int]
    devices: list[torch.device]
    chunks: int
    checkpoint: str

    def __init__(self, module: nn.Sequential, balance: Iterable[int] | None = None, *,
                 devices: Iterable[Device] | None = None, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False) -> None:
        super().__init__()
        chunks, checkpoint = int(chunks), str(checkpoint)
        if balance is None:
            raise ValueError(recommend_auto_balance("balance is required"))
        if chunks <= 0:
            raise ValueError(f"number of chunks must be positive integer (chunks: {chunks})")
        if checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never' (got {checkpoint!r})")
        verify_module(module)
        verify_skippables(module)  # static: before any forward
        counts = list(balance)
        if any(int(n) != n for n in counts):
            raise ValueError(recommend_auto_balance(f"all balance numbers must be integers (balance: {counts})"))
        balance = [int(n) for n in counts]
        if sum(balance) != len(module):
            raise ValueError(recommend_auto_balance(
                f"module and sum of balance have different length (module: {len(module)}, sum of balance: "
                f"{sum(balance)})"))
        if any(n <= 0 for n in balance):
            raise ValueError(recommend_auto_balance(
                f"all balance numbers must be positive integer (balance: {balance})"))
        if devices is None:
            devs = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] \
                if torch.cuda.is_available() else [torch.device("cpu")] * len(balance)
        else:
            devs = [torch.device(d) for d in devices]
        if len(balance) > len(devs):
            raise IndexError(f"too few devices to hold given partitions (devices: {len(devs)}, partitions: "
                             f"{len(balance)})")
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)
        self.chunks, self.checkpoint = chunks, checkpoint
        self.balance, self.devices = balance, devs[: len(balance)]
        layers = list(module.named_children())
        parts, start = [], 0
        for n, device in zip(balance, self.devices, strict=True):
            parts.append(nn.Sequential(OrderedDict(layers[start: start + n])).to(device))
            start += n
        self.partitions = nn.ModuleList(parts)
        # The nn.Sequential of the same layers and its Pipeline, built at the first forward: no submodule of GPipe
        # (its layers are the partitions'), and not copied with it.
        self._runner: _Runner | None = None

    # -- an nn.Sequential's behaviour -------------------------------------------------------------

    def __len__(self) -> int:
        """The layers of the module."""
        return len(self._layers())

    def __getitem__(self, index: int) -> nn.Module:
        """Layer `index` of the module (negative: from the end); IndexError past either end."""
        layers = self._layers()
        if not -len(layers) <= index < len(layers):
            raise IndexError(f"index {index} is out of range for {len(layers)} layers")
        return layers[index]

    def __iter__(self) -> Iterator[nn.Module]:
        """The layers of the module, in order."""
        return iter(self._layers())

    def _layers(self) -> list[nn.Module]:
        return [layer for partition in self.partitions for layer in cast(nn.Sequential, partition)]

    # -- placement is GPipe's: moving is refused, casting is not ----------------------------------

    def cuda(self, device: Device | None = None) -> GPipe:
        raise _moving_denied()

    def cpu(self) -> GPipe:
        raise _moving_denied()

    def to(self, *args: Any, **kwargs: Any) -> GPipe:  # a dtype only
        """A dtype cast (`to(torch.float64)`, `to(dtype=...)`); TypeError for a device or a tensor to follow."""
        if "device" in kwargs or "tensor" in kwargs:
            raise _moving_denied()
        if args and isinstance(args[0], torch.device | int | str | torch.Tensor):
            raise _moving_denied()
        return super().to(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_runner"] = None  # threads: a copy builds its own at its first forward
        return state

    # -- running ----------------------------------------------------------------------------------

    def _pipeline(self) -> _Runner:
        if self._runner is None:
            model = nn.Sequential(OrderedDict(
                (name, layer) for partition in self.partitions for name, layer in partition.named_children()))
            pipe = Pipeline(model, balance=self.balance, chunks=self.chunks, activation_checkpoint=self.checkpoint,
                            devices=self.devices, seed=torch.initial_seed() & ((1 << 63) - 1))
            self._runner = _Runner(model, pipe)
        return self._runner

    def forward(self, input: Any) -> Any:
        """The module's output on mini-batch `input`, a tensor or a tuple of tensors (the batch on dim 0), and
        so is each partition's output; TypeError for anything else.

        As torchgpipe's, in either mode: with gradients enabled the output is connected to autograd, the layers
        in the mode GPipe's train() or eval() gave them; under torch.no_grad() it is not, and in training mode
        the layers still run in it (BatchNorm updates its running statistics). Under torch.inference_mode(), a
        forward only, in eval mode."""
        _check_tensors(input, "input")
        if not self.partitions:  # an empty nn.Sequential is allowed: the identity
            return input
        runner = self._pipeline()
        grad = torch.is_grad_enabled()
        forward_only = not grad and (not self.training or torch.is_inference_mode_enabled())
        # The flag the Pipeline reads (this one alone): its forward with autograd (the layers run in their own
        # modes, which the Pipeline leaves as they are), or forward only, in eval mode.
        runner.model.training = not forward_only
        if forward_only or grad:
            output = runner.pipe(input)
        else:  # training mode under no_grad: the training forward, its state freed with the attached output
            with torch.enable_grad():
                attached = runner.pipe(input)
            output = _detached(attached)
            del attached
        _check_tensors(output, "output")
        return output


@dataclass
class _Runner:
    """The nn.Sequential of GPipe's layers that its gpipe.Pipeline runs."""

    model: nn.Sequential
    pipe: Pipeline


def _detached(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in output) if isinstance(output, tuple) \
        else output
