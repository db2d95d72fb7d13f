"""An optimizer by import path, checked before any worker starts (validate, serve's submit, run).

Such a class is unknown until it runs, so `check` runs it: it imports the class, binds the options against
its __init__ (an unknown option names itself and the known ones), builds it on two small dummy parameters on
the CPU and takes two steps, so that the class's own value checks ("Invalid alpha value") answer at once,
naming the option without which it succeeds. A step that needs a closure (LBFGS evaluates the loss again) is
refused: a stage steps once per batch, with the gradients of that batch.

The state it then keeps must be what a checkpoint stores without pickling: per parameter, tensors
(safetensors) and int, float, bool, str or None (JSON), under string keys; its hyper-parameters JSON too.
Loaded into a new instance as a resumed stage loads it (gpipe.optim.restore), that state must step as the
original does. The steps also measure the memory model's state slots: the state tensors shaped like their
parameter.

Errors are OptimizerError, one line that starts with the field below `optimizer` it blames (`name`,
`args.alpha`, `lr`).
"""

from __future__ import annotations

import inspect
import json
import re
from typing import TYPE_CHECKING, Any

from gpipe.optim import load, restore, saved_groups
from gpipe.show import first_line

if TYPE_CHECKING:
    import torch

JSON_SCALARS = (int, float, bool, str, type(None))  # what a checkpoint's JSON holds of the optimizer's state
_STEPS = 2  # dummy steps: a class may make its state at the first and change it at the next


class OptimizerError(ValueError):
    """An optimizer by import path that a job cannot use: one line, starting with the field it blames."""


def check(path: str, kwargs: dict[str, Any]) -> int:
    """Check the optimizer at `path` with keyword arguments `kwargs` (lr and args) as the module's docstring
    says; its state tensors per parameter, measured. OptimizerError with one line."""
    import torch

    from gpipe.factory import FactoryError

    try:
        cls = load(path)
    except FactoryError as e:
        raise OptimizerError(f"name: {e}") from None
    _bind(path, cls, kwargs)
    _steps_alone(path, cls)
    try:
        opt, params = _dummy_steps(cls, kwargs)
    except _Failed as e:
        raise OptimizerError(f"{_culprit(cls, kwargs, e.error)}: {path} {e.what}: {first_line(e.error)}") from None
    _check_storable(path, opt, params)
    _check_resumes(path, cls, kwargs, opt, params)
    return max(sum(isinstance(v, torch.Tensor) and v.shape == p.shape for v in opt.state[p].values())
               for p in params)


class _Failed(Exception):
    def __init__(self, what: str, error: Exception):
        self.what, self.error = what, error


def _dummy_steps(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                 ) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """`cls` built with `kwargs` on two small parameters, after _STEPS steps (_Failed says where it failed)."""
    import torch

    with torch.random.fork_rng(devices=[]):  # a class that draws at random draws from its own stream here
        params = [torch.nn.Parameter(torch.linspace(-1.0, 1.0, 6).reshape(2, 3)),
                  torch.nn.Parameter(torch.linspace(0.5, -0.5, 3))]
        try:
            opt = cls(params, **kwargs)
        except Exception as e:
            raise _Failed("refused its options", e) from None
        for k in range(_STEPS):
            for p in params:
                p.grad = torch.full_like(p, 0.1 * (k + 1)) - p.detach() / 10
            try:
                opt.step()
            except Exception as e:
                raise _Failed("failed at a step", e) from None
    return opt, list(params)


def _culprit(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], error: Exception) -> str:
    """The field to blame for the class's own error: the one option without which the steps succeed, else
    the one option its message names, else `args`."""
    def field(key: str) -> str:
        return "lr" if key == "lr" else f"args.{key}"

    def passes(without: str) -> bool:
        try:
            _dummy_steps(cls, {k: v for k, v in kwargs.items() if k != without})
        except _Failed:
            return False
        return True

    if len(alone := [k for k in kwargs if k != "lr" and passes(k)]) == 1:
        return field(alone[0])
    if len(named := [k for k in kwargs if re.search(rf"(?<!\w){re.escape(k)}(?!\w)", str(error))]) == 1:
        return field(named[0])
    return "args"


def _bind(path: str, cls: type, kwargs: dict[str, Any]) -> None:
    """Every option a parameter of cls.__init__ (after the parameters), and every one it needs given."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return  # no signature to read: the class's own checks, at the dummy step, answer
    named = [p for p in sig.parameters.values() if p.kind is not p.VAR_POSITIONAL]
    if not named or named[0].kind not in (named[0].POSITIONAL_ONLY, named[0].POSITIONAL_OR_KEYWORD):
        raise OptimizerError(f"name: {path} takes no parameters first (its __init__ is {cls.__name__}{sig})")
    options = {p.name: p for p in named[1:] if p.kind is not p.VAR_KEYWORD}
    any_option = any(p.kind is p.VAR_KEYWORD for p in named[1:])
    known = ", ".join(options) or "none"
    for key in kwargs:
        if key not in options and not any_option:
            field = "lr" if key == "lr" else f"args.{key}"
            raise OptimizerError(f"{field}: {path} takes no option {key!r} (it takes {known})")
    for name, p in options.items():
        if p.default is p.empty and name not in kwargs:
            raise OptimizerError(f"args.{name}: {path} needs it (it has no default)")


def _steps_alone(path: str, cls: type[torch.optim.Optimizer]) -> None:
    """A step that needs an argument (LBFGS's closure) is refused: a stage calls step() with none."""
    try:
        sig = inspect.signature(cls.step)
    except (TypeError, ValueError):
        return
    needed = [p.name for p in list(sig.parameters.values())[1:]
              if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if needed:
        raise OptimizerError(f"name: {path}'s step needs {', '.join(needed)} (a closure evaluates the loss again); "
                             "a stage steps once per batch, with that batch's gradients, and passes nothing")


def _check_storable(path: str, opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """The state a checkpoint stores without pickling: per parameter, tensors and JSON scalars under string
    keys (a checkpoint names a tensor optim/<param>/<key>); JSON hyper-parameters."""
    import torch

    from gpipe.stream import DTYPES

    own = {id(p) for p in params}
    if any(id(key) not in own for key in opt.state):
        raise OptimizerError(f"name: {path} keeps state that belongs to no parameter; a checkpoint stores each "
                             "parameter's state only")
    for p in params:
        for key, v in opt.state[p].items():
            if not isinstance(key, str) or not key or "/" in key:
                raise OptimizerError(f"name: {path} keeps state under the key {key!r}; a checkpoint needs a "
                                     "string without '/' (it names the tensor optim/<param>/<key>)")
            if isinstance(v, torch.Tensor):
                if v.dtype not in DTYPES or v.layout != torch.strided:
                    raise OptimizerError(f"name: {path} keeps its state {key!r} as a {v.dtype} {v.layout} tensor, "
                                         "which a checkpoint (safetensors) does not store")
            elif not isinstance(v, JSON_SCALARS):
                raise OptimizerError(f"name: {path} keeps its state {key!r} as a {type(v).__name__}; a checkpoint "
                                     "stores tensors and int, float, bool, str or None, and pickles nothing")
    for group in opt.param_groups:
        for key, v in group.items():
            if key != "params" and not _json(v):
                raise OptimizerError(f"name: {path} keeps its hyper-parameter {key!r} as a {type(v).__name__}; a "
                                     "checkpoint stores them as JSON (numbers, strings, lists of them)")


def _check_resumes(path: str, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                   opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """The state as a checkpoint keeps it (tensors as they are, the rest through JSON), loaded into a new
    instance as a resumed stage loads it, steps as the original does."""
    import torch

    def through_json(v: Any) -> Any:
        return json.loads(json.dumps(v))

    state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else through_json(v) for k, v in opt.state[p].items()}
             for i, p in enumerate(params)}
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    with torch.random.fork_rng(devices=[]):
        try:
            again = cls(twins, **kwargs)
            groups = through_json([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
            restore(again, state, saved_groups(again.param_groups, groups))
            for o, ps in ((opt, params), (again, twins)):
                torch.manual_seed(0)  # one draw for both, should the step draw
                for p in ps:
                    p.grad = torch.full_like(p, 0.3) - p.detach() / 5
                o.step()
        except Exception as e:
            raise OptimizerError(f"name: {path}'s state does not load back as a checkpoint keeps it: "
                                 f"{first_line(e)}") from None
    if not all(torch.equal(p, q) for p, q in zip(params, twins, strict=True)):
        raise OptimizerError(f"name: {path} steps differently once its state has been through a checkpoint "
                             "(tensors as they are, numbers as JSON, loaded by load_state_dict): a resumed job "
                             "would not go on as it would have")


def _json(v: object) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_json(x) for x in v)
    return isinstance(v, JSON_SCALARS)
