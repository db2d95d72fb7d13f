"""The schedules under gpipe.schedule's simulator: bubble and activation peak against 1f1b (docs/schedules.md).

    python bench/simulated.py [--workers 2 4] [--chunks 8]

Every registered schedule (two model chunks a worker for those that take several), at the simulator's costs
(a forward a tick, a backward two, a split backward's B and W one each; a model chunk of a two-chunk schedule
half a stage, its ticks half as long). "bubble": one step alone (simulate's bubble_fraction); "in a row": steps
one after another, each worker starting its next as soon as its own is done (gpipe.schedule.steady, no worker
waiting for another at a step's end); "peak": the most activations a worker holds at once, in stages' worth of
one micro-batch (a model chunk of two: half), and that over 1f1b's (P, on its first stage). Pure arithmetic: no
model runs.
"""

from __future__ import annotations

import argparse

from gpipe import schedule


def row(name: str, workers: int, chunks: int) -> tuple[float, float, float] | None:
    """(bubble, bubble in a row, peak in stages' worth); None where the schedule does not take these options."""
    record = schedule.REGISTRY[name]
    virtual = 1 if record.model_chunks == (1,) else 2
    if record.model_chunks is not None and virtual not in record.model_chunks:
        return None
    if (record.rounds and chunks % workers) or chunks < record.min_rounds * workers:
        return None
    sim = schedule.simulate(name, workers, chunks, virtual)
    split = [schedule.splits_backward(schedule.build(name, k, workers, chunks, virtual)) for k in range(workers)]
    _, steady = schedule.steady(name, workers, chunks, virtual,
                                lambda k, a: schedule.cost(a.kind, split[k]))
    return sim.bubble_fraction, steady, max(sim.max_in_flight) / virtual


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--chunks", type=int, default=8)
    a = ap.parse_args()
    for p in a.workers:
        one = row("1f1b", p, a.chunks)
        assert one is not None
        print(f"\n{p} workers, {a.chunks} micro-batches")
        print("| schedule | bubble | in a row | activation peak (stages) | of 1f1b's |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name in schedule.names():
            got = row(name, p, a.chunks)
            if got is None:
                print(f"| {name} | - | - | - | - |")
                continue
            bubble, steady, peak = got
            print(f"| {name} | {bubble:.3f} | {steady:.3f} | {peak:g} | {peak / one[2]:.2f} |")


if __name__ == "__main__":
    main()
