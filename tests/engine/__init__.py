"""The engine's tests, in process: gpipe.Pipeline, schedules, a Stage, capture, balance, precision, BatchNorm,
what crosses a cut; no process started."""
