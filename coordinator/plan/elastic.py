"""Elastic stages: the shapes a job may re-plan onto, and which worker serves which slot.

A worker's rank is its identity and its preferred slot: rank N serves slot N
(stage N mod P of replica N div P) when it is there. A slot whose worker is
gone may be taken by a spare: an idle worker whose own rank this job does
not use. When no spare is left and the job says `elastic: {min_stages: K}`,
it re-plans onto the workers that remain, trying these shapes in order and
taking the first that fits (replicas x stages workers)::

    replicas 4 x stages 3  (the spec's)
    replicas 2 x stages 3  (fewer replicas first: chunks x 2)
    replicas 1 x stages 3  (chunks x 4)
    replicas 1 x stages 2  (then fewer stages, down to K)

Every shape trains on the same micro-batches as the spec's: replicas x chunks
is kept (a replica that goes takes its micro-batches to the others, in the
same order: gpipe.coordinator.plan.data), and a shape whose cut of the batch would
differ (a batch that does not split evenly) is passed over. So the weights
are those of one uninterrupted run.

With `virtual_stages: V` each worker still holds V model chunks, placed by the
schedule: a shape of S stages cuts the model into S x V chunks, resumed from
the checkpoint as any resume onto another cut is. interleaved-1f1b runs a
replica's micro-batches in rounds of S, so a shape where they are not a
multiple of S is passed over too.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpipe import schedule as schedules
from gpipe.coordinator.spec.job import MAX_CHUNKS, JobSpec
from gpipe.topology import Topology


def _split(n: int, parts: int) -> list[int]:
    """The sizes torch.tensor_split cuts `n` rows into: the first n mod parts one longer."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def micro_batch_sizes(batch: int, replicas: int, chunks: int) -> list[int]:
    """The sizes of a step's replicas x chunks micro-batches, in order (gpipe.coordinator.plan.data's cut)."""
    return [m for shard in _split(batch, replicas) for m in _split(shard, chunks)]


def shapes(spec: JobSpec) -> Iterator[Topology]:
    """The shapes the job may run on, best first: the spec's, fewer replicas, then fewer stages."""
    yield spec.topology
    if spec.elastic is None:
        return
    want = micro_batch_sizes(spec.data.batch_size, spec.replicas, spec.chunks)
    total = spec.replicas * spec.chunks

    def same(replicas: int) -> bool:  # replicas x (total / replicas) cuts the batch as the spec does
        return total % replicas == 0 and total // replicas <= MAX_CHUNKS \
            and micro_batch_sizes(spec.data.batch_size, replicas, total // replicas) == want

    def rounds(stages: int, replicas: int) -> bool:  # interleaved-1f1b's rounds of `stages` micro-batches
        return not schedules.REGISTRY[spec.schedule].rounds or spec.virtual_stages == 1 or \
            (total // replicas) % stages == 0

    for replicas in range(spec.replicas - 1, 0, -1):
        if same(replicas) and rounds(spec.stages, replicas):
            yield spec.topology_at(spec.stages, replicas)
    if same(1):  # then one replica, on fewer stages
        for stages in range(spec.stages - 1, spec.elastic.min_stages - 1, -1):
            if rounds(stages, 1):
                yield spec.topology_at(stages, 1)


def shape_for(spec: JobSpec, workers: int) -> Topology | None:
    """The best shape of `spec` that `workers` workers can carry; None: not even min_stages'."""
    return next((t for t in shapes(spec) if t.world <= workers), None)


def describe(t: Topology) -> str:
    """'3 stages' or '2 replicas x 3 stages'."""
    stages = f"{t.stages} stage{'s' if t.stages > 1 else ''}"
    return stages if t.replicas == 1 else f"{t.replicas} replicas x {stages}"
