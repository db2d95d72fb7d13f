"""gpipe: GPipe-style pipeline parallelism; `gpipe.Pipeline` runs a model's stages as threads of this process.

The rest of the package is what the coordinator and the workers share (schedules, factories, RNG, networking).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpipe.pipeline import Pipeline

__all__ = ["Pipeline"]


def __getattr__(name: str) -> Any:
    # Imported when first used: the service's processes import gpipe's modules without torch's start-up cost.
    if name == "Pipeline":
        from gpipe.pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'gpipe' has no attribute {name!r}")
