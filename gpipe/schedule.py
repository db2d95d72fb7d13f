"""Pipeline schedules as data: for each stage, the ordered actions of one step.

An action is a forward (F), a backward (B) or a weight-gradient pass (W) of one
micro-batch. The receive of a forward's input and the send of its output (and
the same for a backward's gradient) are implied by the action: receives run on
the stage's channel threads, posted ahead of time, and sends are posted without
waiting for the peer. A schedule with W actions splits each backward
(gpipe.split_backward): B then computes only the gradients of the stage's
inputs, which the stage before waits for, and W, later, those of its weights.

The tables are `simulate`'s, under its cost model (`cost`): a forward takes a
tick, a whole backward two, a split backward's B and W one each. A cell is
the action each stage runs at each tick (. idle).

gpipe (fill-drain), 4 stages, 4 micro-batches:

    tick      0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20
    stage 0  F0 F1 F2 F3  .  .  .  .  .  .  .  .  . B3 B3 B2 B2 B1 B1 B0 B0
    stage 1   . F0 F1 F2 F3  .  .  .  .  .  . B3 B3 B2 B2 B1 B1 B0 B0  .  .
    stage 2   .  . F0 F1 F2 F3  .  .  . B3 B3 B2 B2 B1 B1 B0 B0  .  .  .  .
    stage 3   .  .  . F0 F1 F2 F3 B3 B3 B2 B2 B1 B1 B0 B0  .  .  .  .  .  .

1f1b, 4 stages, 6 micro-batches: stage k runs stages-k-1 warm-up forwards,
then alternates one forward and one backward, so it holds at most stages-k
micro-batches' activations at once (gpipe holds all of them). Both take
3(M+P-1) ticks for M micro-batches on P stages: the bubble is (P-1)/(M+P-1).

    tick      0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26
    stage 0  F0 F1 F2 F3  .  .  .  .  .  . B0 B0 F4 B1 B1 F5 B2 B2  . B3 B3  . B4 B4  . B5 B5
    stage 1   . F0 F1 F2  .  .  .  . B0 B0 F3 B1 B1 F4 B2 B2 F5 B3 B3  . B4 B4  . B5 B5  .  .
    stage 2   .  . F0 F1  .  . B0 B0 F2 B1 B1 F3 B2 B2 F4 B3 B3 F5 B4 B4  . B5 B5  .  .  .  .
    stage 3   .  .  . F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 F4 B4 B4 F5 B5 B5  .  .  .  .  .  .

zb-h1 (zero bubble, arXiv 2401.10241), 4 stages, 6 micro-batches: 1f1b's
order with the backward split, stage k's W running k micro-batches behind its
B. Only F and B are on the path between stages, so the B's of the drain come
back a tick apart, and the W's left over fill the time 1f1b's stage k waits
there. It takes 3M+P-1 ticks (M >= P): the bubble is (P-1)/(3M+P-1), about a
third of 1f1b's. Every stage holds at most P micro-batches' activations (from
F to W), the most 1f1b holds (on stage 0).

    tick      0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20
    stage 0  F0 F1 F2 F3  .  .  . B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5
    stage 1   . F0 F1 F2  .  . B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5
    stage 2   .  . F0 F1  . B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5
    stage 3   .  .  . F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5

interleaved-1f1b (Megatron), 2 workers, virtual_stages 2, 2 micro-batches:
the model is cut into 4 model chunks, model chunk c on worker c mod 2 (F0.1:
micro-batch 0 on the worker's model chunk 1, the model's 3 on worker 1). A
model chunk is half a stage, so a tick is half as long: 15 half-ticks where 1f1b takes 9 ticks
(the bubble (P-1)/(VM+P-1)). Micro-batches go in rounds of the workers.

    tick         0    1    2    3    4    5    6    7    8    9   10   11   12   13   14
    worker 0    F0   F1 F0.1 F1.1    .    . B0.1 B0.1    . B1.1 B1.1   B0   B0   B1   B1
    worker 1     .   F0   F1 F0.1 B0.1 B0.1 F1.1 B1.1 B1.1   B0   B0   B1   B1    .    .

zbv (zero bubble V), 2 workers, 3 micro-batches: worker k holds model chunks
k and 2P-1-k (worker 0 the first and the last), the backward split as
in zb-h1; 19 half-ticks, the bubble (P-1)/(6M+P-1) for M >= 2P-1:

    tick         0    1    2    3    4    5    6    7    8    9   10   11   12   13 ...
    worker 0    F0   F1   F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1   B0   W0 F2.1 B2.1 W2.1 ...
    worker 1     .   F0 F0.1   F1 F1.1 B0.1 W0.1   F2   B0   W0 F2.1 B1.1 W1.1   B1 ...

v-half and v-min (gpipe/vshape.py: "Pipeline Parallelism with Controllable
Memory", arXiv 2405.15362) place the model as zbv does and split the backward,
but space the passes of a micro-batch so that a worker holds about half (v-half)
or a third (v-min) of 1f1b's activations for many workers: (P+2)//2 and (P+4)//3
stages' worth against 1f1b's P. dualpipev (gpipe/dualpipev.py) is DualPipeV's
order of forward and backward pairs on the same V, the pairs run one after the
other; it takes 2P micro-batches or more.

(The cost model is the usual one: a backward does about twice a forward's
work, half of it for the inputs and half for the weights. The first stage's
inputs want no gradient, so its B does nothing and its W the whole backward;
nothing waits on it there.)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from gpipe import dualpipev as _dualpipev
from gpipe import vshape
from gpipe.topology import model_chunk, place  # which worker holds which model chunk: decided there


class Action(NamedTuple):
    kind: Literal["F", "B", "W"]
    micro_batch: int
    worker_chunk: int = 0  # which of the worker's model chunks it runs on: 0..virtual-1 (gpipe.topology.place)

    def __repr__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.worker_chunk}" if self.worker_chunk else "")


def gpipe(stage: int, stages: int, chunks: int) -> list[Action]:
    """All forwards in order, then all backwards in reverse (as torchgpipe does)."""
    return [Action("F", i) for i in range(chunks)] + [Action("B", i) for i in reversed(range(chunks))]


def one_f_one_b(stage: int, stages: int, chunks: int) -> list[Action]:
    """Warm up with stages-stage-1 forwards, then alternate forward and backward, then drain."""
    warmup = min(stages - stage - 1, chunks)
    actions = [Action("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < chunks:
        actions += [Action("F", f), Action("B", b)]
        f, b = f + 1, b + 1
    actions += [Action("B", i) for i in range(b, chunks)]
    return actions


def zb_h1(stage: int, stages: int, chunks: int) -> list[Action]:
    """1f1b's order with each backward split into B and W, stage k's W running k micro-batches behind its B:
    the W's left at the end fill the drain, where 1f1b's stage k waits k backwards for the stages before it.
    Every stage then holds at most `stages` micro-batches (1f1b's stage 0 does too)."""
    actions: list[Action] = []
    w = 0  # the next W
    for a in one_f_one_b(stage, stages, chunks):
        actions.append(a)
        if a.kind == "B" and a.micro_batch - stage >= 0:
            actions.append(Action("W", w))
            w += 1
    return actions + [Action("W", i) for i in range(w, chunks)]


def interleaved_1f1b(stage: int, stages: int, chunks: int, virtual: int) -> list[Action]:
    """Megatron's interleaved 1F1B: worker `stage` holds `virtual` model chunks (its model chunk c is the model's
    c*stages+stage: gpipe.topology.place). Forwards go a round of `stages` micro-batches through its model chunk 0,
    the same round through its model chunk 1, and so on; backwards likewise from the last. The warm-up is 1f1b's
    doubled, plus a round per extra model chunk. `chunks` (micro-batches) must be a multiple of `stages`."""
    if virtual == 1:
        return one_f_one_b(stage, stages, chunks)
    p, total = stages, chunks * virtual

    def nth(i: int, backward: bool) -> tuple[int, int]:  # (micro-batch, worker chunk) of the worker's i-th F or B
        group, j = divmod(i, p * virtual)
        c = j // p
        return group * p + j % p, virtual - 1 - c if backward else c

    warmup = min(total, 2 * (p - stage - 1) + (virtual - 1) * p)
    actions = [Action("F", *nth(i, False)) for i in range(warmup)]
    for f in range(warmup, total):
        actions += [Action("F", *nth(f, False)), Action("B", *nth(f - warmup, True))]
    return actions + [Action("B", *nth(b, True)) for b in range(total - warmup, total)]


def zbv(stage: int, stages: int, chunks: int, virtual: int) -> list[Action]:
    """Zero bubble V (arXiv 2401.10241, section 6): worker k holds model chunks k (its chunk 0) and
    2*stages-1-k (its chunk 1), a V, so the last model chunk is on worker 0; backwards split into B and W.
    Warm-up: its model chunk 0's forwards, then its model chunk 1's interleaved, each forward on model chunk 1
    on the worker nearest the V's bottom followed at once by its B and W; steady state: F, B, W on model chunk
    0 then on model chunk 1; the drain
    runs the B's first and fills the gaps with the W's left. Built for 2*stages-1 micro-batches or more (the
    actions of micro-batches past `chunks` are dropped), as torch.distributed.pipelining's builder is."""
    if virtual != 2:
        raise ValueError(f"virtual_stages: zbv holds 2 model chunks per worker, not {virtual}")
    p, k = stages, stage
    n = max(2 * p - 1, chunks)
    count = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}
    actions: list[Action] = []

    def run(*steps: str) -> None:  # "F1": a forward of the next micro-batch on the worker's model chunk 1
        for step in steps:
            kind, c = step[0], int(step[1])
            actions.append(Action(kind, count[(kind, c)], c))  # type: ignore[arg-type]  # kind is F, B or W
            count[(kind, c)] += 1

    for _ in range(2 * (p - k) - 1):
        run("F0")
    for _ in range(k):
        run("F1", "F0")
    for _ in range(p - k):
        run("F1", "B1", "W1")
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n:
        if count[("F", 0)] < n:
            run("F0")
        run("B0", "W0", "F1", "B1", "W1")
    for _ in range(k):
        run("B0", "B1")
    for _ in range(p - k):
        run("B0", "W0")
    for c in (1, 0):
        while count[("W", c)] < count[("B", c)]:
            run(f"W{c}")
    return [a for a in actions if a.micro_batch < chunks]


def _v_only(name: str, virtual: int) -> None:
    if virtual != 2:
        raise ValueError(f"virtual_stages: {name} holds 2 model chunks per worker, not {virtual}")


def v_half(stage: int, stages: int, chunks: int, virtual: int) -> list[Action]:
    """V-Half (arXiv 2405.15362, gpipe/vshape.py): zbv's V and split backward, its passes spaced so that a worker
    holds at most (stages+2)//2 stages' worth of activations (about half of 1f1b's `stages`). Any `chunks`."""
    _v_only("v-half", virtual)
    return [Action(*s) for s in vshape.steps("half", stage, stages, chunks)]


def v_min(stage: int, stages: int, chunks: int, virtual: int) -> list[Action]:
    """V-Min (arXiv 2405.15362, gpipe/vshape.py): as v-half, each pass right after what it waits for: at most
    (stages+4)//3 stages' worth of activations (about a third of 1f1b's), for more bubble. Any `chunks`."""
    _v_only("v-min", virtual)
    return [Action(*s) for s in vshape.steps("min", stage, stages, chunks)]


def measured_unit(stage: int, stages: int, chunks: int, virtual: int) -> list[Action]:
    """`measured` without a job's costs (gpipe.Pipeline, the simulator's tables): gpipe.measured's order built
    at the cost model's lengths (`cost`), with no memory budget. A job's own is built before it starts, from
    its measured costs, and runs as a table (`table`)."""
    from gpipe import measured  # here: gpipe.measured builds on this module

    if virtual not in (1, 2):
        raise ValueError(f"virtual_stages: measured holds 1 or 2 model chunks per worker, not {virtual}")
    return list(measured.unit(stages, chunks, virtual)[stage])


def dualpipev(stage: int, stages: int, chunks: int, virtual: int) -> list[Action]:
    """DualPipeV (gpipe/dualpipev.py): DeepSeek's forward and backward pairs on zbv's V, a pair run one after the
    other; `chunks` at least 2*stages (ValueError below that)."""
    _v_only("dualpipev", virtual)
    return [Action(*s) for s in _dualpipev.steps(stage, stages, chunks)]


@dataclass(frozen=True)
class Record:
    """One schedule, and everything the rest of gpipe asks of it: its builder, how many model chunks a worker
    holds and where, the rules its options follow, whether `auto` and `plan` search it, and its sentence in
    the spec's reference. Adding a schedule is one record, registered here (`register`): the spec's checks
    (gpipe.options), the placement (gpipe.topology), `gpipe.Pipeline`, the stages, the simulator and `plan`'s
    search all read it from REGISTRY."""

    name: str
    build: Callable[[int, int, int, int], list[Action]]  # (worker, workers, micro-batches, model chunks/worker)
    doc: str  # its sentence in the spec's reference (docs/spec.md: `schedule`)
    model_chunks: tuple[int, ...] | None = (1,)  # the model chunks per worker it takes; None: any number
    v_shape: bool = False  # worker k holds model chunks k and 2*workers-1-k (a V), not k, k+workers, ...
    rounds: bool = False  # with several model chunks a worker, micro-batches go in rounds of `workers`
    min_rounds: int = 0  # micro-batches at least min_rounds x `workers` (dualpipev: 2); fewer are refused
    searched_with: int | None = 1  # the model chunks per worker `auto` and `plan` search it with; None: never


# A schedule given as its table of actions takes a name of its own (gpipe.measured writes and reads them):
# "table:" and each worker's actions in order (Action's repr: F3, B0.1), workers apart by " / ":
# "table:F0 F1 B0 W0 B1 W1 / F0 B0 W0 F1 B1 W1". It places model chunks as zbv does with 2 a worker. FILE: a
# table still to be read from a CSV file (`schedule: {file: order.csv}`), when the job is planned.
TABLE = "table:"
FILE = "file:"
_TOKEN = re.compile(r"([FBW])(\d{1,9})(?:\.(\d))?")


def is_table(name: object) -> bool:
    """Whether `name` is a table's (TABLE)."""
    return isinstance(name, str) and name.startswith(TABLE)


def is_file(name: object) -> bool:
    """Whether `name` is a table still to be read from its CSV file (FILE)."""
    return isinstance(name, str) and name.startswith(FILE)


class _Registry(dict[str, Record]):
    """The records by name. A table's name (a schedule given as its actions: `table`, or a CSV file's to read:
    FILE) finds the tables' record though none is listed under it, so whatever asks the registry about a
    schedule's name (the placement, the option rules, the spec) asks it of a table too."""

    def __missing__(self, name: str) -> Record:
        record = _table_record(name) if isinstance(name, str) else None
        if record is None:
            raise KeyError(name)
        return record

    def get(self, name: str, default: Any = None) -> Any:  # tables too
        try:
            return self[name]
        except KeyError:
            return default

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or is_table(name) or is_file(name)


REGISTRY: dict[str, Record] = _Registry()


def register(record: Record) -> Record:
    """Add a schedule: from now on a stage runs it, `auto` and `plan` search it (unless searched_with is None)."""
    if record.name in REGISTRY:
        raise ValueError(f"schedule {record.name!r} is registered already")
    REGISTRY[record.name] = record
    return record


def names() -> list[str]:
    """Every schedule's name, in the order they were registered (the spec reference's)."""
    return list(REGISTRY)


def several_chunks() -> list[str]:
    """The schedules that take several model chunks a worker."""
    return [n for n, r in REGISTRY.items() if r.model_chunks != (1,)]


def searched() -> dict[str, int]:
    """The schedules `auto` and `plan` search, with the model chunks a worker each is searched with."""
    return {n: r.searched_with for n, r in REGISTRY.items() if r.searched_with is not None}


def reference() -> str:
    """The spec's description of `schedule`: each schedule's sentence, in order."""
    return " ".join(r.doc for r in REGISTRY.values())


def _one_chunk(builder: Callable[[int, int, int], list[Action]]) -> Callable[[int, int, int, int], list[Action]]:
    return lambda stage, stages, chunks, virtual: builder(stage, stages, chunks)


for _record in (
    Record("gpipe", _one_chunk(gpipe), "gpipe: all forwards, then all backwards."),
    Record("1f1b", _one_chunk(one_f_one_b), "1f1b: one forward, one backward; stage k keeps at most stages-k "
           "micro-batches in flight."),
    Record("zb-h1", _one_chunk(zb_h1), "zb-h1: 1f1b with each backward split into B (the inputs' gradients) "
           "and W (the weights', later, filling the drain): about a third of 1f1b's bubble, at most `stages` "
           "micro-batches in flight on any stage."),
    Record("interleaved-1f1b", interleaved_1f1b, "interleaved-1f1b (Megatron): each worker holds "
           "virtual_stages model chunks (model chunk c on worker c mod stages), the bubble divided by their "
           "number; chunks a multiple of stages.", model_chunks=None, rounds=True, searched_with=2),
    Record("zbv", zbv, "zbv: virtual_stages 2, worker k holding model chunks k and 2*stages-1-k (a V), the "
           "backward split as zb-h1's: about no bubble at 1f1b's activation memory.", model_chunks=(2,),
           v_shape=True, searched_with=2),
    Record("v-half", v_half, "v-half (Pipeline Parallelism with Controllable Memory): zbv's V and split "
           "backward, at most (stages+2)//2 stages' worth of activations on a worker (about half of 1f1b's), "
           "any chunks.", model_chunks=(2,), v_shape=True, searched_with=2),
    Record("v-min", v_min, "v-min: as v-half, at most (stages+4)//3 stages' worth (about a third of 1f1b's), "
           "for more bubble; any chunks.", model_chunks=(2,), v_shape=True, searched_with=2),
    Record("dualpipev", dualpipev, "dualpipev: DualPipeV's forward and backward pairs on zbv's V, run one "
           "after the other; chunks at least 2*stages.", model_chunks=(2,), v_shape=True, min_rounds=2,
           searched_with=2),
    Record("measured", measured_unit, "measured: each worker's order built before the job starts from the "
           "job's own costs (each model chunk's F, B and W, the transfers, measured as plan measures them) and "
           "its memory budget, by list scheduling (docs/schedules.md); never slower in the simulator than the "
           "best fixed schedule that fits the same budget; virtual_stages 1, or 2 in zbv's V.",
           model_chunks=(1, 2), v_shape=True, searched_with=None),
):
    register(_record)

# The schedules a job spec may name: the records above (tests/engine/test_schedule.py holds them together).
Name = Literal["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv", "v-half", "v-min", "dualpipev", "measured"]

def table(orders: Sequence[Sequence[Action]]) -> str:
    """The name of the schedule whose worker k runs `orders[k]` (TABLE)."""
    return TABLE + " / ".join(" ".join(map(repr, row)) for row in orders)


@functools.lru_cache(maxsize=64)
def parse_table(name: str) -> tuple[tuple[Action, ...], ...]:
    """Each worker's actions of a table's name (TABLE); ValueError naming the first word that is none."""
    rows = []
    for k, part in enumerate(name[len(TABLE):].split("/")):
        row = []
        for i, word in enumerate(part.split()):
            m = _TOKEN.fullmatch(word)
            if m is None:
                raise ValueError(f"worker {k}'s action {i}: {word[:20]!r} is not F, B or W with a micro-batch "
                                 "(F3, or B3.1 on the worker's model chunk 1)")
            row.append(Action(m[1], int(m[2]), int(m[3] or 0)))  # type: ignore[arg-type]  # F, B or W
        rows.append(tuple(row))
    return tuple(rows)


def table_shape(orders: Sequence[Sequence[Action]]) -> tuple[int, int, int]:
    """(workers, micro-batches, model chunks a worker) of a table: its rows, worker 0's forwards on its model
    chunk 0, and the worker chunks its actions name."""
    chunks = sum(1 for a in orders[0] if a.kind == "F" and a.worker_chunk == 0) if orders else 0
    virtual = 1 + max((a.worker_chunk for row in orders for a in row), default=0)
    return len(orders), chunks, virtual


def _table_build(name: str) -> Callable[[int, int, int, int], list[Action]]:
    def build(stage: int, stages: int, chunks: int, virtual: int) -> list[Action]:
        orders = parse_table(name)
        if table_shape(orders) != (stages, chunks, virtual):
            p, m, v = table_shape(orders)
            raise ValueError(f"schedule: the table is of {p} worker(s), {m} micro-batch(es) and {v} model "
                             f"chunk(s) a worker, not {stages}, {chunks} and {virtual}")
        return list(orders[stage])
    return build


def _file_build(stage: int, stages: int, chunks: int, virtual: int) -> list[Action]:
    raise ValueError("schedule: a table in a file is read when the job is planned (gpipe.measured.read_csv)")


_FILE_RECORD = Record("file", _file_build, "", model_chunks=(1, 2), v_shape=True, searched_with=None)


@functools.lru_cache(maxsize=64)
def _table_record(name: str) -> Record | None:
    """The record of a table's name (TABLE, FILE): its own builder, zbv's V with 2 model chunks a worker."""
    if is_file(name):
        return _FILE_RECORD
    if not is_table(name):
        return None
    return Record(name, _table_build(name), "", model_chunks=(1, 2), v_shape=True, searched_with=None)


def build(name: str, stage: int, stages: int, chunks: int, virtual: int = 1) -> list[Action]:
    """The actions of worker `stage` for one step of the schedule `name` (`virtual` model chunks per worker)."""
    return REGISTRY[name].build(stage, stages, chunks, virtual)


def splits_backward(actions: list[Action]) -> bool:
    """Whether a stage's actions split the backward: B then only the inputs' gradients, W the weights'."""
    return any(a.kind == "W" for a in actions)


def cost(kind: str, split: bool) -> int:
    """An action's length in ticks, the simulator's cost model: a forward 1, a whole backward 2 (twice the
    forward's work: the gradients of the inputs and of the weights), and a split backward's B and W 1 each."""
    return 1 if kind == "F" or split else 2


class Simulation(NamedTuple):
    ticks: int  # the step's length, in ticks
    timeline: list[list[Action | None]]  # [stage][tick]: the action running (for each of its ticks), or idle
    max_in_flight: list[int]  # per stage: micro-batches forwarded whose activations are still held

    @property
    def bubble_fraction(self) -> float:
        busy = sum(a is not None for row in self.timeline for a in row)
        return 1.0 - busy / (len(self.timeline) * self.ticks)


def simulate(name: str, stages: int, chunks: int, virtual: int = 1) -> Simulation:
    """Run a schedule under the cost model (`cost`) with instant transfers.

    A forward of micro-batch i on model chunk g (gpipe.topology.place; without
    virtual stages, g is the stage) needs model chunk g-1's forward of i; a
    backward (B) needs model chunk g+1's (or, on the last model chunk, its own
    forward); a W follows its own B. Each action starts
    as soon as its worker is free and what it needs has ended. A micro-batch's
    activations are held from its forward to its backward (to its W, when the
    backward is split). Raises RuntimeError if no worker can make progress: a
    deadlock.
    """
    plans = [build(name, k, stages, chunks, virtual) for k in range(stages)]
    split = [splits_backward(plan) for plan in plans]
    runs = timing(name, stages, chunks, virtual, lambda k, a: cost(a.kind, split[k]))
    ticks = int(max((end for row in runs for _, _, end in row), default=0))
    timeline: list[list[Action | None]] = []
    for row in runs:
        cells: list[Action | None] = [None] * ticks
        for a, start, end in row:
            cells[int(start):int(end)] = [a] * int(end - start)
        timeline.append(cells)
    return Simulation(ticks, timeline, [_held(plan, s) for plan, s in zip(plans, split, strict=True)])


def timing(name: str, stages: int, chunks: int, virtual: int,
           length: Callable[[int, Action], float]) -> list[list[tuple[Action, float, float]]]:
    """Per worker, (action, start, end) of each of its actions, in order, where action `a` of worker k takes
    `length(k, a)` (simulate's rules, with any lengths: measured ones give the bubble a schedule leaves with
    the stages' real costs, transfers and per-step overheads left out). The bubble is 1 - (the sum of the
    lengths) / (workers x the latest end)."""
    return _timing(name, [build(name, k, stages, chunks, virtual) for k in range(stages)], virtual, length)


def steady(name: str, stages: int, chunks: int, virtual: int, length: Callable[[int, Action], float],
           steps: int = 4, waits: Sequence[Collection[int]] = ()) -> tuple[float, float]:
    """(period, bubble) of schedule `name` run step after step, as the service runs it: a worker starts its next
    step as soon as it has ended its own (its optimizer step needs only its own gradients), so step s+1's first
    forwards overlap the W's and backwards that end step s on the other workers. `waits`: sets of workers that
    end each step waiting for one another (a tied weight's holders sum its gradient; clipping and fp16's
    overflow check: every worker), none of whom starts the next step before all of them have ended this one.
    The period is how far apart the last two of `steps` steps end; the bubble 1 - (one step's lengths) /
    (workers x the period). `length` sees each action as in one step alone (micro-batches 0..chunks-1)."""
    one = [build(name, k, stages, chunks, virtual) for k in range(stages)]
    plans = [[a._replace(micro_batch=a.micro_batch + s * chunks) for s in range(steps) for a in plan] for plan in one]
    ends = [plan[-1] if plan else None for plan in one]  # each worker's last action of a step (unshifted)
    peers = {k: sorted({j for group in waits if k in group for j in group} - {k}) for k in range(stages)}

    def after(k: int, a: Action) -> list[tuple[int, Action]]:  # the first action of a step waits for the peers
        s = a.micro_batch // chunks
        if not s or a != plans[k][s * len(one[k])]:
            return []
        return [(j, e._replace(micro_batch=e.micro_batch + (s - 1) * chunks)) for j in peers[k]
                if (e := ends[j]) is not None]

    def unshifted(k: int, a: Action) -> float:
        return length(k, a._replace(micro_batch=a.micro_batch % chunks))

    runs = _timing(name, plans, virtual, unshifted, after if any(peers.values()) else None)
    last = [max(end for row in runs for a, _, end in row if a.micro_batch // chunks == s) for s in range(steps)]
    period = last[-1] - last[-2] if steps > 1 else last[-1]
    busy = sum(length(k, a) for k, plan in enumerate(one) for a in plan)
    return period, 1.0 - busy / (stages * period) if period > 0 else 0.0


def _timing(name: str, plans: list[list[Action]], virtual: int, length: Callable[[int, Action], float],
            after: Callable[[int, Action], list[tuple[int, Action]]] | None = None,
            ) -> list[list[tuple[Action, float, float]]]:
    """`timing` of any plans; `after(k, a)`: more actions (of any worker) that `a` on worker k waits for."""
    stages = len(plans)
    pos = [0] * stages
    free = [0.0] * stages  # when each worker's last action ended
    done: dict[tuple[int, Action], float] = {}  # (worker, action) -> when it ended
    runs: list[list[tuple[Action, float, float]]] = [[] for _ in range(stages)]
    while any(p < len(plan) for p, plan in zip(pos, plans, strict=True)):
        moved = False
        for k in range(stages):
            while pos[k] < len(plans[k]):
                a = plans[k][pos[k]]
                dep = _dependency(name, k, a, stages, virtual)
                deps = ([dep] if dep is not None else []) + (after(k, a) if after is not None else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[k], *(done[d] for d in deps)])
                free[k] = done[(k, a)] = start + length(k, a)
                runs[k].append((a, start, free[k]))
                pos[k] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{name}: deadlock, stages waiting at {pos}")
    return runs


def _held(actions: list[Action], split: bool) -> int:
    """The most micro-batches a stage's actions hold at once: forwarded, and not yet backwarded (not yet through
    their W, when the backward is split)."""
    held = peak = 0
    end = "W" if split else "B"
    for a in actions:
        held += 1 if a.kind == "F" else -1 if a.kind == end else 0
        peak = max(peak, held)
    return peak


def dependency(name: str, k: int, a: Action, stages: int, virtual: int) -> tuple[int, Action] | None:
    """The action of another worker (or the worker's own forward) that `a` on worker k waits for; None for a
    W (after its own B, earlier in the worker's order) and the first model chunk's forwards."""
    return _dependency(name, k, a, stages, virtual)


def _dependency(name: str, k: int, a: Action, stages: int, virtual: int) -> tuple[int, Action] | None:
    """The action of another worker (or the worker's own forward) that `a` on worker k waits for."""
    g = model_chunk(name, k, a.worker_chunk, stages)  # the model chunk it runs on
    if a.kind == "F":
        if g == 0:
            return None
        worker, own = place(name, g - 1, stages)
        return worker, Action("F", a.micro_batch, own)
    if a.kind == "B":
        if g == stages * virtual - 1:
            return k, Action("F", a.micro_batch, a.worker_chunk)
        worker, own = place(name, g + 1, stages)
        return worker, Action("B", a.micro_batch, own)
    return None  # W: after its own B, which comes before it in the worker's order
