"""gpipe: GPipe-style pipeline parallelism; `gpipe.Pipeline` runs a model's stages as threads of this process,
`gpipe.load_weights(model, path)` loads a job's weights (or a checkpoint's) back into its model.

The rest of the package is what the coordinator and the workers share (schedules, factories, RNG, networking).
"""

import importlib.util
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpipe.pipeline import Pipeline
    from gpipe.weights import load_weights

__all__ = ["Pipeline", "load_weights"]

# The torch releases gpipe is tested with (pyproject.toml says the same range; `make test` installs 2.13.0,
# `make gpu-check` runs on the GPU host's own torch). Read without importing torch, which takes seconds.
TORCH_SUPPORTED = ((2, 11), (2, 13))


def _check_torch(version: str) -> None:
    """ImportError, in one line, for a torch older than TORCH_SUPPORTED's (a newer one is the installer's to
    refuse: pyproject.toml's bound)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    (lo, hi), found = TORCH_SUPPORTED, (int(m[1]), int(m[2])) if m else None
    if found is not None and found < lo:
        raise ImportError(f"gpipe supports torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}, but this environment has "
                          f"torch {version}: install a supported release (pip install 'torch>={lo[0]}.{lo[1]},"
                          f"<{hi[0]}.{hi[1] + 1}')")


def _torch_version() -> str | None:
    """torch's release as its own torch/version.py says it, read without importing torch or the installed
    packages' metadata (importlib.metadata alone costs a client verb a tenth of a second); None: not found."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return None
    m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return m[1] if m else None


if (_found := _torch_version()) is not None:
    _check_torch(_found)  # None: torch is not there, or a build without version.py: its import says what it is


def __getattr__(name: str) -> Any:
    # Imported when first used: the service's processes import gpipe's modules without torch's start-up cost.
    if name == "Pipeline":
        from gpipe.pipeline import Pipeline

        return Pipeline
    if name == "load_weights":
        from gpipe.weights import load_weights

        return load_weights
    raise AttributeError(f"module 'gpipe' has no attribute {name!r}")
