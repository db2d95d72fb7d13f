"""The control layer's fixtures: `h`, a supervisor in process with a fake clock and fake workers."""

from __future__ import annotations

import pytest

from tests.support.harness import Harness


@pytest.fixture
def h() -> Harness:
    return Harness()
