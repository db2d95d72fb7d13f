"""The coordinator's side of state in pieces: to a stage as it starts, from a stage at each checkpoint.

Each direction keeps at most IN_FLIGHT messages of at most PIECE_BYTES
(gpipe.stream) per stage, so this process's memory does not grow with the
model: a stage's weights go from the plan (init exact) or from the checkpoint
on disk (resume) straight to the stage; a checkpoint comes from the stage
straight to the file it is written and hashed in (gpipe.coordinator.outputs.checkpoint).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpipe import stream
from gpipe.coordinator.attempt.handle import StageHandle
from gpipe.coordinator.outputs import checkpoint

IN_FLIGHT = 2  # messages of state on the way to or from one stage


@dataclass
class StageSlice:
    """What a stage starting from files is sent (resumed from a checkpoint, or from model.weights): where each of
    its tensors is (one of the files, or this process)."""

    from_disk: dict[str, tuple[int, str]] = field(default_factory=dict)  # its key -> (file, key there)
    in_memory: dict[str, torch.Tensor] = field(default_factory=dict)  # init exact: non-persistent buffers
    declared: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # not weights: (dtype, shape)
    json_state: dict[str, Any] | None = field(default_factory=dict)  # None: not resumed (model.weights)

    def pieces(self, files: Sequence[checkpoint.Shard]) -> Iterator[stream.Piece]:
        """Every tensor's pieces, read from disk one at a time (`files`: a checkpoint's shards, or the
        pretrained weights' files)."""
        yield from stream.pieces(self.in_memory)
        for key in sorted(self.from_disk):
            k, src = self.from_disk[key]
            for off, data in files[k].pieces(src):
                yield key, off, data


def send_pieces(stage: StageHandle, pieces: Iterable[stream.Piece],
                check: Callable[[torch.futures.Future[Any]], object]) -> int:
    """Send `pieces` to a stage's receive(), batched up to PIECE_BYTES a message, IN_FLIGHT at most
    unanswered; `check` raises a failed answer. Returns the bytes sent."""
    futs: deque[torch.futures.Future[Any]] = deque()
    batch: list[stream.Piece] = []
    size = sent = 0

    def flush() -> None:
        futs.append(stage.receive(batch))
        while len(futs) >= IN_FLIGHT:
            check(futs.popleft())

    for piece in pieces:
        batch.append(piece)
        size += len(piece[2])
        if size >= stream.PIECE_BYTES:
            flush()
            sent, batch, size = sent + size, [], 0
    if batch:
        flush()
        sent += size
    while futs:
        check(futs.popleft())
    return sent


def from_stage(stage: StageHandle, desc: dict[str, Any]) -> checkpoint.StageStream:
    """A stage's checkpoint copy (as its step's answer described it), pulled in pieces as the writer writes it."""
    step, count = int(desc["step"]), int(desc["pieces"])

    def pieces() -> Iterator[torch.Tensor]:
        done = False
        try:
            ahead: deque[torch.futures.Future[torch.Tensor]] = deque()
            for i in range(count):
                while len(ahead) < IN_FLIGHT and i + len(ahead) < count:
                    ahead.append(stage.snapshot_piece(step, i + len(ahead)))
                yield ahead.popleft().wait()
            done = True
        finally:
            if not done or count == 0:  # the last piece lets the copy go; otherwise say so
                with contextlib.suppress(Exception):
                    stage.drop_snapshot(step)

    return checkpoint.StageStream(desc["header"], int(desc["data_bytes"]), desc["json_state"], pieces)
