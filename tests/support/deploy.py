"""deploy/ as Kubernetes objects: what `kubectl kustomize` renders of each target."""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
import warnings
from typing import Any

import pytest
import yaml

from tests.support.cli import ROOT

DEPLOY = ROOT / "deploy"
Obj = dict[str, Any]


@functools.cache
def _render(target: str) -> tuple[Obj, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        reason = "kubectl is not installed, so deploy/ cannot be rendered (kubectl kustomize)"
        warnings.warn(reason, stacklevel=1)   # in the warnings summary, whatever -r says
        pytest.skip(reason)
    p = subprocess.run([kubectl, "kustomize", str(DEPLOY / target)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, f"kubectl kustomize deploy/{target} failed: {p.stderr.strip()}"
    return tuple(d for d in yaml.safe_load_all(p.stdout) if d)


def render(target: str) -> list[Obj]:
    """The objects `kubectl kustomize deploy/<target>` renders (a copy the caller may change)."""
    return copy.deepcopy(list(_render(target)))

