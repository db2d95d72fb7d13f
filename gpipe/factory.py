"""Resolve 'module:function' strings and registered short names to callables."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpipe.errors import SpecError, describe_os_error

# Short names for the factories that ship with gpipe.
REGISTRY: dict[str, str] = {
    "mlp": "gpipe.builtins:mlp",
    "random_regression": "gpipe.builtins:random_regression",
    "tokens": "gpipe.data.tokens:tokens",
    "hf_dataset": "gpipe.data.hf_dataset:hf_dataset",
    "cross_entropy": "gpipe.losses:cross_entropy",
    "mse": "gpipe.losses:mse",
    "model": "gpipe.losses:model_loss",
}


class FactoryError(LookupError):
    """A 'module:function' reference that names nothing callable, or whose module cannot be imported: the job's
    code is missing or broken where it runs (a restart cannot fix it). A LookupError the job's own code raises
    (a data set's IndexError, a KeyError) is no FactoryError."""


_own_code: list[str] = []  # this process's copy of the job's code (gpipe.service.code_archive), when the job sent it


def enter_job_folder(folder: str | Path) -> None:
    """Make `folder`, the job's folder, this process's working directory, so that the job's factories find
    a relative path (data/train.bin) in the job's folder wherever they run: under `run`, the job file's
    folder (or its working_dir); under serve, the job's code unpacked, on the coordinator and every worker.
    `model.weights` resolves against the same folder (gpipe.coordinator.plan.job).

    Once per process, and only in a process of the job's own (an attempt's coordinator or worker process,
    validate): never in serve's, which runs many jobs. Paths the process was given relative to where it
    started must be made absolute first. A folder that is not there is SpecError."""
    try:
        os.chdir(folder)
    except OSError as e:
        raise SpecError(f"the job's folder: {describe_os_error(e, 'entering')}") from None


def use_job_code(folder: str) -> None:
    """Import the job's modules from `folder`, this process's own copy of the job's code, and from no folder
    a stage config names (the coordinator's copy: on another machine, or none at all); it is the process's
    working directory too (enter_job_folder)."""
    folder = os.path.abspath(folder)  # on sys.path: a relative one would follow the working directory
    _own_code[:] = [folder]
    if folder not in sys.path:
        sys.path.insert(0, folder)
    enter_job_folder(folder)


def add_import_paths(paths: Sequence[str]) -> None:
    """Let user modules next to the job file be imported, as Python does for a script."""
    if _own_code:
        return
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)


def resolve(ref: str) -> Callable[..., Any]:
    """Return the callable named by `ref`; raise FactoryError with a one-line reason."""
    target = REGISTRY.get(ref, ref)
    if ":" not in target:
        known = ", ".join(sorted(REGISTRY))
        raise FactoryError(f"{ref!r} is neither 'module:function' nor a registered name ({known})")
    mod_name, _, attr = target.partition(":")
    try:
        obj: object = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise FactoryError(f"cannot import module {e.name!r}") from None
    except Exception as e:  # a user module that fails while importing
        raise FactoryError(f"importing {mod_name!r} raised {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise FactoryError(f"module {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise FactoryError(f"{target!r} is not callable")
    return obj
