"""Optimizer classes as a job's own code writes them: the user's class that tests train with, and broken ones
that validate refuses (tests/control/test_optim_check.py)."""

from __future__ import annotations

from typing import Any

import torch

# A job's own optimizer, written as a module next to its job file (optimizer.name: my_optim:SoftSignMomentum):
# per parameter, a tensor (its momentum) and a JSON number (its step count) of state, and a value check.
USER_MODULE = "my_optim"
USER_CODE = '''
import torch


class SoftSignMomentum(torch.optim.Optimizer):
    """Momentum of the gradients; each step moves every weight by lr * m / (1 + |m|), m its momentum."""

    def __init__(self, params, lr=0.01, beta=0.9, weight_decay=0.0):
        if not 0 <= beta < 1:
            raise ValueError(f"Invalid beta value: {beta}")
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                    state["steps"] = 0
                state["steps"] += 1
                state["momentum"].mul_(group["beta"]).add_(p.grad + group["weight_decay"] * p)
                m = state["momentum"]
                p.add_(m / (1 + m.abs()), alpha=-group["lr"])
'''


class _Plain(torch.optim.Optimizer):
    """SGD, keeping `state(p)` as its state for each parameter."""

    def __init__(self, params: Any, lr: float = 0.01):
        super().__init__(params, {"lr": lr})

    def state_of(self, p: torch.Tensor) -> dict[Any, Any]:
        return {"momentum": torch.zeros_like(p)}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(self.state_of(p))
                p.add_(p.grad, alpha=-group["lr"])


class ListState(_Plain):
    """Keeps a list, which a checkpoint would have to pickle."""

    def state_of(self, p: torch.Tensor) -> dict[Any, Any]:
        return {"history": [1.0, 2.0]}


class SlashKey(_Plain):
    """Keeps a tensor under a key with '/', which a checkpoint's tensor names cannot hold."""

    def state_of(self, p: torch.Tensor) -> dict[Any, Any]:
        return {"a/b": torch.zeros_like(p)}


class SharedState(_Plain):
    """Keeps state that belongs to no parameter."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        super().step()
        self.state["total"] = {"steps": 1}


class CallableGroup(_Plain):
    """A hyper-parameter that is a function: not JSON."""

    def __init__(self, params: Any, lr: float = 0.01):
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, "rule": abs})


class NeedsRho(_Plain):
    """An option with no default."""

    def __init__(self, params: Any, rho: float, lr: float = 0.01):
        super().__init__(params, lr)


class TwoSlots(_Plain):
    """Two tensors shaped like each parameter and one number tensor: two state slots."""

    def state_of(self, p: torch.Tensor) -> dict[Any, Any]:
        return {"m": torch.zeros_like(p), "v": torch.zeros_like(p), "step": torch.tensor(1.0)}


def not_an_optimizer(params: Any, lr: float) -> None:
    """A function, not an Optimizer subclass."""


class IntCounter(_Plain):
    """Counts its steps in an int64 tensor, which torch's load_state_dict casts to the parameter's float32:
    resumed, it indexes with a float and fails."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["count"] = state.get("count", torch.tensor(0)) + 1
                p.add_(p.grad, alpha=-group["lr"] * (1.0, 0.5, 0.25)[state["count"] % 3])


class Forgetful(_Plain):
    """Keeps its momentum, but loads none back (a state it rebuilds in load_state_dict): resumed, it differs."""

    def state_of(self, p: torch.Tensor) -> dict[Any, Any]:
        m = self.state[p].get("momentum", torch.zeros_like(p))
        return {"momentum": m * 0.9 + p.grad}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(self.state_of(p))
                p.add_(self.state[p]["momentum"], alpha=-group["lr"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict({**state_dict, "state": {}})
