"""The suite's fixtures and tiers: `cli` (tests.support.cli.Cli, nothing left behind), and the markers and
pytest-xdist groups each collected test gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import Cli, end_leftovers


@pytest.fixture
def cli(tmp_path: Path):
    c = Cli(tmp_path)
    yield c
    left = end_leftovers(c)
    assert not left, f"processes left behind: {left}"


def _visible_gpus() -> int:
    """The CUDA devices torch sees here (0 with a CPU build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    """The tiers: a multiprocess test not marked `path` is marked `full` (make test leaves it to make test-all).
    For `make test`'s parallel run (pytest-xdist, --dist loadgroup): the tests that share a module's
    processes (a module-scoped fixture of ours: one serve, one finished run) go to one xdist worker, so
    those processes start once; and the tests that start processes are handed out first, the groups
    before them, so the long ones do not come last."""
    def shared(item) -> str | None:
        for name in item.fixturenames:
            defs = item._fixtureinfo.name2fixturedefs.get(name)
            if defs and defs[-1].scope != "function" and defs[-1].baseid:  # ours, not pytest's own
                return f"{item.module.__name__}:{name}"
        return None

    gpus: int | None = None
    for item in items:
        if (group := shared(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        if item.get_closest_marker("multiprocess") is not None and item.get_closest_marker("path") is None:
            item.add_marker(pytest.mark.full)  # make test-all's tier (pyproject's markers)
        if (mark := item.get_closest_marker("gpu")) is not None:
            if gpus is None:
                gpus = _visible_gpus()
            need = int(mark.args[0]) if mark.args else 1
            if gpus < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), this machine has {gpus} "
                                                 "(make gpu-check runs these on a GPU host)"))
    items.sort(key=lambda item: (shared(item) is None, item.get_closest_marker("multiprocess") is None))
