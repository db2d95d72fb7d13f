"""dualpipev: DualPipeV's order of forwards and backwards on zbv's V (gpipe.schedule's record).

DualPipeV is DeepSeek's DualPipe (DeepSeek-V3 technical report, arXiv 2412.19437) cut in half: P workers, worker
k holding model chunks k and 2P-1-k (its chunks 0 and 1, the V that zbv uses), at least 2P micro-batches. Its
steady state pairs a forward on one of a worker's model chunks with a backward on the other, which DualPipe
overlaps (the forward's computation under the backward's communication and the other way round); here a pair
runs one after the other, the forward first, as torch.distributed.pipelining's ScheduleDualPipeV runs its pairs
when nothing overlaps them. Worker k's step, in the order that schedule builds (its steps 1 to 8):

1. 2(P-k-1) forwards on model chunk 0;
2. k+1 times: a forward on model chunk 0, then one on model chunk 1;
3. P-k-1 times: B on model chunk 1, the oldest W left, a forward on model chunk 1;
4. M-2P+k+1 times: the pairs (F on chunk 0, backward on chunk 1) and (F on chunk 1, backward on chunk 0);
5. P-k-1 times: a backward on model chunk 1, then the pair (F on chunk 1, backward on chunk 0);
6. k+1 times: a backward on model chunk 1, then one on model chunk 0, from half-way on split: B now, W later;
7. P-k-1 times: the oldest W left, then a backward on model chunk 0 (split if step 6 began splitting);
8. the W's left.

A whole backward is B then its W at once (the interpreter splits every backward of a step that has W's: a B
followed by its W computes what the whole backward does). Each worker's actions come back as (kind,
micro-batch, worker chunk) triples (gpipe.schedule.Action's fields), each model chunk's in micro-batch order.
"""

from __future__ import annotations

from typing import Literal

Kind = Literal["F", "B", "W"]
Step = tuple[Kind, int, int]  # (kind F/B/W, micro-batch, the worker's model chunk 0 or 1)


def steps(worker: int, stages: int, chunks: int) -> list[Step]:
    """Worker `worker`'s actions of one step of DualPipeV on `stages` workers (`chunks` >= 2 * stages)."""
    p, k = stages, worker
    if chunks < 2 * p:
        raise ValueError(f"chunks: dualpipev takes at least 2 x {p} workers = {2 * p} micro-batches, not {chunks}")
    out: list[Step] = []
    forwards, backwards = [0, 0], [0, 0]  # per model chunk: the next micro-batch
    later: list[Step] = []  # B's whose W is still to come, oldest first

    def forward(c: int) -> None:
        out.append(("F", forwards[c], c))
        forwards[c] += 1

    def backward(c: int, split: bool = False) -> None:  # whole (B, then its W) or split (its W later)
        b: Step = ("B", backwards[c], c)
        backwards[c] += 1
        out.append(b)
        if split:
            later.append(b)
        else:
            out.append(("W", b[1], c))

    def weight() -> None:  # the oldest W left, if any
        if later:
            b = later.pop(0)
            out.append(("W", b[1], b[2]))

    for _ in range(2 * (p - k - 1)):  # 1
        forward(0)
    for _ in range(k + 1):  # 2
        forward(0)
        forward(1)
    for _ in range(p - k - 1):  # 3
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(chunks - 2 * p + k + 1):  # 4
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(p - k - 1):  # 5
        backward(1)
        forward(1)
        backward(0)
    split = False
    for i in range(k + 1):  # 6: the second half split, from chunk 1's backward on odd workers, chunk 0's on even
        split = split or (i == (k + 1) // 2 and k % 2 == 1)
        backward(1, split)
        split = split or (i == (k + 1) // 2 and k % 2 == 0)
        backward(0, split)
    for _ in range(p - k - 1):  # 7
        weight()
        backward(0, split)
    while later:  # 8
        weight()
    return out
