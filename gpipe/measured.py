"""`schedule: measured`: each worker's order built from a job's own costs and memory; schedules as tables.

The builder is list scheduling in the manner of the zero-bubble paper's automatic scheduler (Qi, Wan, Huang,
Lin, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 3.1's heuristic). The workers' actions are
laid out in time, with each action's own length (its model chunk's F, B or W at its micro-batch's size, the
transfer after it on the sender, as `plan` counts them: gpipe.coordinator.plan.search.step_time), and a worker,
whenever it is free, takes the ready action that keeps the critical path busy:

1. a W first when a forward is ready but the micro-batches the worker holds leave no room for it (its memory
   limit, in bytes of activations held from a forward to its W);
2. a ready B (the path back to the first model chunk runs through it), or, where the policy says so, a ready
   forward first while the worker holds fewer micro-batches than its warm-up depth;
3. a ready forward, if the worker then holds at most its warm-up depth and its memory limit; on the V (two
   model chunks a worker, zbv's placement), the one on model chunk 0 or 1 first, as the policy says;
4. else a W, which nothing waits for, filling what would be idle time: unless a forward or a B arrives
   before a given share of the W's length has run (then the worker waits for it, and the W fills a later gap).

Each micro-batch's room is taken at its forward on the worker's model chunk 0, for both of its model chunks
(on the V, its model chunk 1 runs when the micro-batch has come back), so a worker never holds more than its
limit and no order deadlocks while the limit admits one micro-batch. Every dependency holds by construction:
a forward after the model chunk before's, a B after the model chunk after's (on the last one, its own
forward), a W after its B; each model chunk's forwards, B's and W's in micro-batch order.

The policies (how deep the warm-up, a forward or a B first, how much of a gap a W fills, split backwards or
whole, on the V which model chunk's forward first) each give an order; each is simulated (gpipe.schedule.steady:
steps in a row, as the service runs them, or the caller's `score`), and the fastest kept (of two as fast, the
one that holds less). The fixed schedules of the same placement (gpipe, 1f1b and zb-h1; on the V zbv, v-half,
v-min and dualpipev) whose activations stay within the same limits are simulated too, and where no built order
is faster than the fastest of them by MARGIN (1%: what the measured costs can tell apart), that fixed
schedule's order is the answer: measured is never slower in the simulator than the best fixed schedule within
the budget.

A schedule so built runs as a table (gpipe.schedule.table: its name carries each worker's actions), which
plan.json shows (auto.schedule_table) and a file gives back (`schedule: {file: order.csv}`, `read_table`): that
plan.json itself, or CSV, one row per action, `worker,order,kind,micro_batch,chunk` (chunk: the model chunk, in
model order; `python -m gpipe.measured plan.json` writes it), or torch.distributed.pipelining's compute-only
CSV (a row per rank, cells such as 1F0, 1I0, 1W0, 1B0). A table is checked whole before it runs
(`check`): every micro-batch's F and B (and W, when the backward is split) exactly once on each model chunk,
each after what it needs on its worker, forwards in micro-batch order, and no deadlock (simulated).
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from gpipe import schedule
from gpipe.schedule import Action
from gpipe.topology import model_chunk, place

NAME = "measured"  # its record's name: the placement (zbv's V with two model chunks a worker) is that record's
COLUMNS = ("worker", "order", "kind", "micro_batch", "chunk")  # a table's CSV: one row per action
MAX_ACTIONS = 1 << 16  # a table's actions at most (a CSV's rows), every worker's together
MAX_CSV_BYTES = 1 << 22
MAX_WORKERS = 64
# Past MANY actions (every worker's together), the policies of the few that win most often only.
MANY = 4096
# A built order replaces the fastest fixed schedule only when the simulator finds it this much faster: the costs
# it is built from are measured within a few percent, and a fixed schedule's order has run before.
MARGIN = 0.01

# (worker, action, split: whether the backward is split) -> its length in seconds (any unit), transfers on the sender
Length = Callable[[int, Action, bool], float]
# (worker, a forward: its micro-batch and worker chunk) -> the bytes it holds until its W (its B, when not split)
Held = Callable[[int, Action], float]


class TableError(ValueError):
    """A table that cannot run: one line naming its row."""


@dataclass(frozen=True)
class Policy:
    """One way of choosing among ready actions (the module's docstring)."""

    split: bool  # B and W apart; else whole backwards (B), no W
    depth: tuple[int, int]  # the warm-up's depth on worker k: a*(workers-k)+b micro-batches (a=0: b alone)
    forward_first: bool  # a ready forward before a ready B, within the depth
    fill: float  # a W runs in a gap of at least this share of its length (0: any)
    deep_first: bool  # on the V, a ready forward on model chunk 1 before one on model chunk 0


@dataclass(frozen=True)
class Built:
    """What `build` chose: the schedule (a table's name), where its order comes from ("measured", or the fixed
    schedule whose order won), its simulated step, and each fixed schedule's (None: over the memory limits, or
    not for this shape)."""

    name: str
    source: str
    step: float
    fixed: dict[str, float | None]

    @property
    def orders(self) -> tuple[tuple[Action, ...], ...]:
        return schedule.parse_table(self.name)


@dataclass(frozen=True)
class Costs:
    """A cost table by model chunk (model order): a forward's seconds, a split backward's B's and W's, an
    unsplit backward's (`whole`; default B+W), the transfer between model chunk g and g+1 (`send[g]`: an
    activation forward, its gradient back, on the sender), and the bytes a micro-batch holds on it (`held`).
    The first model chunk's input wants no gradient: split, its B does nothing and its W all of the backward."""

    f: Sequence[float]
    b: Sequence[float]
    w: Sequence[float]
    send: Sequence[float] = ()
    held: Sequence[float] = ()
    whole: Sequence[float] = ()

    def length(self, stages: int) -> Length:
        last = len(self.f) - 1

        def length(k: int, a: Action, split: bool) -> float:
            g = model_chunk(NAME, k, a.worker_chunk, stages)
            whole = self.whole[g] if self.whole else self.b[g] + self.w[g]
            send = self.send[g] if self.send and g < last else 0.0
            back = self.send[g - 1] if self.send and g > 0 else 0.0
            if a.kind == "F":
                return self.f[g] + send
            if a.kind == "W":
                return whole if g == 0 else self.w[g]
            if not split:
                return whole + back
            return (0.0 if g == 0 else self.b[g]) + back
        return length

    def held_by(self, stages: int) -> Held:
        return lambda k, a: self.held[model_chunk(NAME, k, a.worker_chunk, stages)] if self.held else 1.0


def fixed_names(stages: int, chunks: int, virtual: int) -> list[str]:
    """The fixed schedules of this placement that take this shape: one model chunk a worker, or the V."""
    from gpipe.options import violation  # here: gpipe.options asks this module about tables

    out = []
    for name, r in schedule.REGISTRY.items():
        if name == NAME or r.model_chunks is None or virtual not in r.model_chunks or (virtual > 1 and not r.v_shape):
            continue
        if violation(name, stages, virtual, chunks) is None:
            out.append(name)
    return out


def held_peaks(orders: Sequence[Sequence[Action]], held: Held) -> list[float]:
    """Per worker, the most bytes its order holds at once: each micro-batch's on a model chunk from its forward
    to its W (to its B, when the backward is not split)."""
    out = []
    for k, row in enumerate(orders):
        end = "W" if schedule.splits_backward(list(row)) else "B"
        now = peak = 0.0
        for a in row:
            if a.kind == "F":
                now += held(k, a)
                peak = max(peak, now)
            elif a.kind == end:
                now -= held(k, a._replace(kind="F"))
        out.append(peak)
    return out


def steady_score(stages: int, chunks: int, virtual: int, length: Length) -> Callable[[str], float]:
    """A schedule's simulated step: gpipe.schedule.steady's period, steps in a row, at `length`."""
    def score(name: str) -> float:
        split = schedule.splits_backward(schedule.build(name, 0, stages, chunks, virtual))
        return schedule.steady(name, stages, chunks, virtual, lambda k, a: length(k, a, split))[0]
    return score


def policies(stages: int, chunks: int, virtual: int) -> list[Policy]:
    """The policies tried: fewer past MANY actions."""
    depths = [(1, 0), (1, 1), (2, -1), (2, 0), (0, stages), (0, 2 * stages), (0, chunks)]
    fills = (0.0, 0.5, 1.0)
    deep = (False, True) if virtual > 1 else (False,)
    out = [Policy(True, d, ff, fill, dp) for d in depths for ff in (False, True) for fill in fills for dp in deep]
    out += [Policy(False, d, ff, 0.0, dp) for d in depths for ff in (False, True) for dp in deep]
    if stages * chunks * virtual * 3 > MANY:
        out = [p for p in out if p.fill == 0.0 and not p.forward_first and p.depth in ((1, 0), (2, -1), (0, stages))]
    return out


def build(stages: int, chunks: int, virtual: int, length: Length, held: Held | None = None,
          limits: Sequence[float] | None = None, score: Callable[[str], float] | None = None) -> Built:
    """The fastest order of `stages` workers, `chunks` micro-batches and `virtual` model chunks a worker (1, or
    2 in the V) at `length`, each worker holding at most `limits[k]` bytes (`held`; none: no limit), by
    `score` (a schedule's name -> its simulated step; default `steady_score`): the best of the policies'
    orders, or of the fixed schedules' within the limits where none is faster (the module's docstring).
    ValueError when no order keeps within the limits (a limit below one micro-batch's bytes)."""
    if virtual not in (1, 2):
        raise ValueError(f"virtual_stages: measured holds 1 or 2 model chunks per worker, not {virtual}")
    held = held or (lambda k, a: 1.0)
    caps = list(limits) if limits is not None else [math.inf] * stages
    score = score or steady_score(stages, chunks, virtual, length)
    fixed: dict[str, float | None] = {}
    # (step, the most a worker holds, name, source): of two as fast, the one holding less
    best: tuple[float, float, str, str] | None = None  # of the fixed schedules
    for name in fixed_names(stages, chunks, virtual):
        orders = [schedule.build(name, k, stages, chunks, virtual) for k in range(stages)]
        peaks = held_peaks(orders, held)
        if any(h > c * (1 + 1e-9) for h, c in zip(peaks, caps, strict=True)):
            fixed[name] = None
            continue
        fixed[name] = step = score(name)
        if best is None or (step, max(peaks)) < best[:2]:
            best = (step, max(peaks), schedule.table(orders), name)
    mine: tuple[float, float, str, str] | None = None  # of the built orders
    seen: set[str] = set()
    for policy in policies(stages, chunks, virtual):
        built = list_schedule(stages, chunks, virtual, length, held, caps, policy)
        if built is None:
            continue
        name = schedule.table(built)
        if name in seen:
            continue
        seen.add(name)
        step, peak = score(name), max(held_peaks(built, held))
        if mine is None or (step, peak) < mine[:2]:
            mine = (step, peak, name, NAME)
    if mine is not None and (best is None or mine[0] < best[0] * (1 - MARGIN)):
        best = mine
    if best is None:
        raise ValueError(f"no order of {chunks} micro-batches keeps each worker within its memory limit "
                         f"({', '.join(f'{c:.3g}' for c in caps)} bytes of activations): not even one micro-batch fits")
    return Built(best[2], best[3], best[0], fixed)


def list_schedule(stages: int, chunks: int, virtual: int, length: Length, held: Held, limits: Sequence[float],
                  policy: Policy) -> list[list[Action]] | None:
    """Each worker's actions, laid out in time under `policy` (the module's docstring); None where the limits
    admit no micro-batch somewhere."""
    p, m, v, split = stages, chunks, virtual, policy.split
    g_of = [[model_chunk(NAME, k, c, p) for c in range(v)] for k in range(p)]
    last = p * v - 1
    kinds = "FBW" if split else "FB"
    release = "W" if split else "B"
    nxt = [[dict.fromkeys(kinds, 0) for _ in range(v)] for _ in range(p)]
    ends: dict[tuple[str, int, int], float] = {}  # (kind, model chunk, micro-batch) -> when it ends
    t = [0.0] * p  # when each worker is free
    room = [0.0] * p  # bytes each worker holds (a micro-batch's, all its model chunks', from its first forward)
    inside = [0] * p  # micro-batches each worker holds
    freed: dict[tuple[int, int], int] = {}  # (worker, micro-batch) -> its model chunks released so far
    a_, b_ = policy.depth
    depth = [max(1, a_ * (p - k) + b_) for k in range(p)]
    need = [[sum(held(k, Action("F", i, c)) for c in range(v)) for i in range(m)] for k in range(p)]
    orders: list[list[Action]] = [[] for _ in range(p)]
    left = [v * m * len(kinds)] * p

    def ready(k: int, c: int, kind: str) -> float | None:
        """When the worker's next `kind` on its model chunk `c` may start; None: none now (all done, or what it
        waits for is not laid out yet)."""
        i, g = nxt[k][c][kind], g_of[k][c]
        if kind == "F":
            if i >= m:
                return None
            return 0.0 if g == 0 else ends.get(("F", g - 1, i))
        if kind == "B":
            if i >= nxt[k][c]["F"]:
                return None
            return ends[("F", g, i)] if g == last else ends.get(("B", g + 1, i))
        return ends[("B", g, i)] if i < nxt[k][c]["B"] else None

    def admits(k: int, c: int) -> tuple[bool, bool]:
        """(within the depth, within the memory limit) for the next forward on model chunk c; on the V, model
        chunk 1's room was taken at model chunk 0's forward."""
        if c:
            return True, True
        i = nxt[k][0]["F"]
        return inside[k] < depth[k], room[k] + need[k][i] <= limits[k] * (1 + 1e-9)

    def choose(k: int, now: float) -> tuple[str, int] | float | None:
        """The action worker k takes at `now` ((kind, worker chunk)); else the earliest known moment something
        becomes ready for it, or None."""
        fs: list[int] = []
        bs: list[int] = []
        ws: list[int] = []
        later: list[float] = []
        blocked = False
        for c in range(v):
            r = ready(k, c, "F")
            if r is not None:
                deep, fits = admits(k, c)
                if r <= now:
                    if deep and fits:
                        fs.append(c)
                    blocked |= not fits
                elif deep and fits:
                    later.append(r)
            r = ready(k, c, "B")
            if r is not None and r <= now:
                bs.append(c)
            elif r is not None:
                later.append(r)
            if split and (r := ready(k, c, "W")) is not None:
                ws.append(c)
        if ws and blocked:
            return "W", _oldest(ws, k, "W")
        if bs and fs and policy.forward_first:
            return "F", _forward(fs)
        if bs:
            return "B", _oldest(bs, k, "B")
        if fs:
            return "F", _forward(fs)
        if ws:
            c = _oldest(ws, k, "W")
            gap = min(later) - now if later else math.inf
            if gap >= policy.fill * length(k, Action("W", nxt[k][c]["W"], c), split):
                return "W", c
        return min(later) if later else None

    def _oldest(cs: list[int], k: int, kind: str) -> int:  # the oldest micro-batch; a tie: the later model chunk
        return min(cs, key=lambda c: (nxt[k][c][kind], -g_of[k][c]))

    def _forward(cs: list[int]) -> int:
        return max(cs) if policy.deep_first else min(cs)

    def run(k: int, kind: str, c: int, now: float) -> None:
        i, g = nxt[k][c][kind], g_of[k][c]
        a = Action(kind, i, c)  # type: ignore[arg-type]  # F, B or W
        end = now + length(k, a, split)
        ends[(kind, g, i)] = t[k] = end
        nxt[k][c][kind] += 1
        orders[k].append(a)
        left[k] -= 1
        if kind == "F" and c == 0:
            room[k] += need[k][i]
            inside[k] += 1
        elif kind == release:
            freed[(k, i)] = freed.get((k, i), 0) + 1
            if freed[(k, i)] == v:
                room[k] -= need[k][i]
                inside[k] -= 1

    while any(left):
        now = min(t[k] for k in range(p) if left[k])
        moved = False
        waits: list[float] = []
        for k in range(p):
            if not left[k] or t[k] > now:
                continue
            got = choose(k, now)
            if isinstance(got, tuple):
                run(k, got[0], got[1], now)
                moved = True
            elif got is not None:
                waits.append(got)
        if moved:
            continue
        later = waits + [t[k] for k in range(p) if left[k] and t[k] > now]
        if not later:
            return None  # every worker waits on another: the limits admit no micro-batch somewhere
        step = min(later)
        for k in range(p):
            if left[k] and t[k] <= now:
                t[k] = step
    return orders


@functools.lru_cache(maxsize=16)
def unit(stages: int, chunks: int, virtual: int) -> tuple[tuple[Action, ...], ...]:
    """`measured` without a job's costs: built at the simulator's cost model (gpipe.schedule.cost), no limit."""
    return build(stages, chunks, virtual, lambda k, a, split: schedule.cost(a.kind, split)).orders


# -- tables: checked whole, written and read as CSV ------------------------------------------------------------


def check(orders: Sequence[Sequence[Action]], label: Callable[[int, int], str] | None = None) -> None:
    """TableError, naming the row (`label(worker, position)`; default "worker k's action i"), unless every
    worker's order can run: every micro-batch's F and B (and W, when any is given) exactly once on each of its
    model chunks, each after what it needs on its worker, forwards in micro-batch order, within MAX_ACTIONS
    and MAX_WORKERS, and no deadlock (simulated)."""
    label = label or (lambda k, i: f"worker {k}'s action {i} ({orders[k][i]!r})")
    p, m, v = schedule.table_shape(orders)
    total = sum(len(row) for row in orders)
    if not 1 <= p <= MAX_WORKERS:
        raise TableError(f"the table has {p} workers: 1 to {MAX_WORKERS}")
    if total > MAX_ACTIONS:
        raise TableError(f"the table has {total} actions, over the {MAX_ACTIONS} a table may have")
    if v > 2:
        raise TableError(f"the table names {v} model chunks a worker: 1, or 2 in zbv's V")
    if m < 1:
        raise TableError("the table has no forward on worker 0's first model chunk: no micro-batch to run")
    split = any(a.kind == "W" for row in orders for a in row)
    kinds = "FBW" if split else "FB"
    for k, row in enumerate(orders):
        seen: dict[Action, int] = {}
        for i, a in enumerate(row):
            g = model_chunk(NAME, k, a.worker_chunk, p)
            if a.micro_batch >= m:
                raise TableError(f"{label(k, i)}: micro-batch {a.micro_batch} is past the table's {m} (worker 0's "
                                 "forwards on its first model chunk)")
            if a in seen:
                raise TableError(f"{label(k, i)}: a second {a.kind} of micro-batch {a.micro_batch} on model chunk {g} "
                                 f"({label(k, seen[a])} is the first)")
            before: Literal["F", "B"] | None = "F" if a.kind == "B" else "B" if a.kind == "W" else None
            if before is not None and a._replace(kind=before) not in seen:
                raise TableError(f"{label(k, i)}: {a.kind} of micro-batch {a.micro_batch} on model chunk {g} comes "
                                 f"before its {before}")
            if a.kind == "F" and a.micro_batch and a._replace(micro_batch=a.micro_batch - 1) not in seen:
                raise TableError(f"{label(k, i)}: forward of micro-batch {a.micro_batch} on model chunk {g} before "
                                 f"that of micro-batch {a.micro_batch - 1}: forwards go in micro-batch order")
            seen[a] = i
        for c in range(v):
            for kind in kinds:
                for mb in range(m):
                    if Action(kind, mb, c) not in seen:  # type: ignore[arg-type]  # F, B or W
                        g = model_chunk(NAME, k, c, p)
                        raise TableError(f"worker {k} has no {kind} of micro-batch {mb} on model chunk {g}"
                                         + (" (a table with W's has one for every B)" if kind == "W" else ""))
    _deadlock_free(orders, label, p, v)


def _deadlock_free(orders: Sequence[Sequence[Action]], label: Callable[[int, int], str], p: int, v: int) -> None:
    pos = [0] * p
    done: set[tuple[int, Action]] = set()
    while any(pos[k] < len(orders[k]) for k in range(p)):
        moved = False
        for k in range(p):
            while pos[k] < len(orders[k]):
                a = orders[k][pos[k]]
                dep = schedule.dependency(NAME, k, a, p, v)
                if dep is not None and dep not in done:
                    break
                done.add((k, a))
                pos[k] += 1
                moved = True
        if not moved:
            k = next(k for k in range(p) if pos[k] < len(orders[k]))
            a = orders[k][pos[k]]
            dep = schedule.dependency(NAME, k, a, p, v)
            assert dep is not None
            g = model_chunk(NAME, dep[0], dep[1].worker_chunk, p)
            raise TableError(f"{label(k, pos[k])}: waits for {dep[1].kind} of micro-batch {dep[1].micro_batch} on "
                             f"model chunk {g} (worker {dep[0]}), which waits in turn: the table deadlocks")


@functools.lru_cache(maxsize=64)
def problem(name: str, stages: int, virtual: int, chunks: int) -> str | None:
    """What is wrong with table `name` for this job's shape, as "field: why"; None when it can run
    (gpipe.options.violation asks)."""
    try:
        orders = schedule.parse_table(name)
        check(orders)
    except ValueError as e:
        return f"schedule: {e}"
    p, m, v = schedule.table_shape(orders)
    if p != stages:
        return f"stages: the table's schedule is for {p} worker(s), not {stages}"
    if v != virtual:
        return f"virtual_stages: the table's workers hold {v} model chunk(s) each, not {virtual}"
    if m != chunks:
        return f"chunks: the table runs {m} micro-batch(es), not {chunks}"
    return None


def rows(orders: Sequence[Sequence[Action]]) -> list[tuple[int, int, str, int, int]]:
    """A table as rows (COLUMNS): worker, its order, kind, micro-batch, model chunk (in model order)."""
    p = len(orders)
    return [(k, i, a.kind, a.micro_batch, model_chunk(NAME, k, a.worker_chunk, p))
            for k, row in enumerate(orders) for i, a in enumerate(row)]


def write_csv(orders: Sequence[Sequence[Action]]) -> str:
    """A table as CSV: COLUMNS, then a row per action (what `read_csv` reads back)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(COLUMNS)
    w.writerows(rows(orders))
    return out.getvalue()


def from_rows(given: Sequence[Sequence[object]]) -> list[list[Action]]:
    """The workers' orders of `rows`' rows (plan.json keeps a measured job's so), checked whole; TableError
    naming the row."""
    if len(given) > MAX_ACTIONS:
        raise TableError(f"{len(given)} rows, over the {MAX_ACTIONS} actions a table may have")
    cells = []
    for n, r in enumerate(given):
        if len(r) != len(COLUMNS) or r[2] not in ("F", "B", "W") or \
                not all(type(x) is int and 0 <= x < MAX_ACTIONS for x in (r[0], r[1], r[3], r[4])):
            raise TableError(f"row {n}: not [worker, order, kind F/B/W, micro-batch, chunk]")
        cells.append((n, int(r[0]), int(r[1]), str(r[2]), int(r[3]), int(r[4])))  # type: ignore[call-overload]
    if not cells:
        raise TableError("no rows")
    return _placed(cells, max(c[1] for c in cells) + 1, lambda n: f"row {n}")


_PEER = re.compile(r"(\d{1,3})(F|I|W|B)(\d{1,9})")


def read_table(text: str) -> list[list[Action]]:
    """A table from a file's text: a plan.json (its `auto.schedule_table`'s rows, a measured job's order) or CSV
    (`read_csv`); TableError naming the row."""
    if not text.lstrip().startswith("{"):
        return read_csv(text)
    if len(text) > MAX_CSV_BYTES:
        raise TableError(f"{len(text)} characters, over the {MAX_CSV_BYTES >> 20} MiB a table may have")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise TableError(f"not JSON: {e}") from None
    table = doc.get("auto", {}).get("schedule_table") if isinstance(doc.get("auto"), dict) else None
    table = table or doc.get("schedule_table")
    if not isinstance(table, dict) or not isinstance(table.get("rows"), list):
        raise TableError("a JSON file's table is plan.json's auto.schedule_table (a measured job's): none here")
    return from_rows(table["rows"])


def read_csv(text: str) -> list[list[Action]]:
    """The workers' orders of a CSV table, checked whole (`check`), or TableError naming the row: this module's
    rows (COLUMNS, a header first), or torch.distributed.pipelining's compute-only format (a row per rank, each
    cell an action: 1F0 a forward of micro-batch 0 on stage 1, I a split backward's input part, W its weight
    part, B a whole backward; empty cells idle)."""
    if len(text) > MAX_CSV_BYTES:
        raise TableError(f"{len(text)} characters, over the {MAX_CSV_BYTES >> 20} MiB a table may have")
    try:
        lines = list(csv.reader(io.StringIO(text)))
    except csv.Error as e:
        raise TableError(f"not CSV: {e}") from None
    first = next((r for r in lines if any(c.strip() for c in r)), None)
    if first is None:
        raise TableError("the file has no rows")
    if [c.strip().lower() for c in first] == list(COLUMNS):
        return _ours(lines)
    return _peer(lines)


def _ours(lines: list[list[str]]) -> list[list[Action]]:
    given: list[tuple[int, int, int, str, int, int]] = []  # (row, worker, order, kind, micro-batch, model chunk)
    header = True
    for n, r in enumerate(lines, 1):
        if not any(c.strip() for c in r):
            continue
        if header:
            header = False
            continue
        if len(given) >= MAX_ACTIONS:
            raise TableError(f"row {n}: over the {MAX_ACTIONS} actions a table may have")
        if len(r) != len(COLUMNS):
            raise TableError(f"row {n}: {len(r)} field(s), not the {len(COLUMNS)} of {','.join(COLUMNS)}")
        kind = r[2].strip()
        if kind not in ("F", "B", "W"):
            raise TableError(f"row {n}: kind {kind[:10]!r} is not F, B or W")
        try:
            k, order, mb, g = (int(r[j]) for j in (0, 1, 3, 4))
        except ValueError:
            raise TableError(f"row {n}: worker, order, micro_batch and chunk are whole numbers") from None
        if not (0 <= k < MAX_WORKERS and 0 <= order < MAX_ACTIONS and 0 <= mb < MAX_ACTIONS and 0 <= g < 2 * MAX_WORKERS):
            raise TableError(f"row {n}: a number out of range (workers below {MAX_WORKERS}, orders and micro-batches "
                             f"below {MAX_ACTIONS})")
        given.append((n, k, order, kind, mb, g))
    if not given:
        raise TableError("the file has a header and no rows")
    p = max(x[1] for x in given) + 1
    cells = [(n, k, order, kind, mb, g) for n, k, order, kind, mb, g in given]
    return _placed(cells, p, lambda n: f"row {n}")


def _peer(lines: list[list[str]]) -> list[list[Action]]:
    cells: list[tuple[int, int, int, str, int, int]] = []
    kinds: dict[str, int] = {}
    p = 0
    for rank, r in enumerate(lines):
        p = rank + 1
        if p > MAX_WORKERS:
            raise TableError(f"row {rank + 1}: over the {MAX_WORKERS} workers a table may have")
        order = 0
        for col, cell in enumerate(r, 1):
            cell = cell.strip()
            if not cell:
                continue
            m = _PEER.fullmatch(cell)
            if m is None:
                raise TableError(f"row {rank + 1}, column {col}: {cell[:20]!r} is not a compute action of torch's "
                                 "CSV (stage, F I W or B, micro-batch: 1F0, 1I0, 1W0, 1B0)")
            if len(cells) >= MAX_ACTIONS:
                raise TableError(f"row {rank + 1}: over the {MAX_ACTIONS} actions a table may have")
            kinds.setdefault(m[2], rank * 100000 + col)
            if "B" in kinds and ("I" in kinds or "W" in kinds):
                raise TableError(f"row {rank + 1}, column {col}: a whole backward (B) in a table that splits them "
                                 "(I and W), or the other way round: one or the other")
            kind = {"F": "F", "I": "B", "W": "W", "B": "B"}[m[2]]
            cells.append((rank * 100000 + col, rank, order, kind, int(m[3]), int(m[1])))
            order += 1
    if not cells:
        raise TableError("the file has no actions")
    return _placed(cells, p, lambda n: f"row {n // 100000 + 1}, column {n % 100000}")


def _placed(cells: list[tuple[int, int, int, str, int, int]], p: int, where: Callable[[int], str],
            ) -> list[list[Action]]:
    """Each worker's actions from (row, worker, order, kind, micro-batch, model chunk) cells: on the worker
    that holds the model chunk (one a worker, or zbv's V), in their order; then `check`."""
    if p > MAX_WORKERS:
        raise TableError(f"{p} workers: a table has at most {MAX_WORKERS}")
    chunks = max(g for *_, g in cells) + 1
    if chunks not in (p, 2 * p):
        raise TableError(f"{p} worker(s) hold {p} model chunks (one each) or {2 * p} (a V), not {chunks}: "
                         f"the table's largest chunk is {chunks - 1}")
    by_worker: list[dict[int, tuple[int, Action]]] = [{} for _ in range(p)]
    for n, k, order, kind, mb, g in cells:
        holder, c = place(NAME, g, p)
        if holder != k:
            raise TableError(f"{where(n)}: model chunk {g} is worker {holder}'s (one model chunk a worker, or "
                             f"zbv's V: worker k holds k and 2P-1-k), not worker {k}'s")
        if order in by_worker[k]:
            raise TableError(f"{where(n)}: worker {k}'s order {order} is given twice ({where(by_worker[k][order][0])} "
                             "too)")
        by_worker[k][order] = (n, Action(kind, mb, c))  # type: ignore[arg-type]  # F, B or W
    for k in range(p):
        if not by_worker[k]:
            raise TableError(f"worker {k} has no actions (workers 0 to {p - 1} each have theirs)")
    ordered = [[by_worker[k][o] for o in sorted(by_worker[k])] for k in range(p)]
    orders = [[a for _, a in row] for row in ordered]
    check(orders, lambda k, i: where(ordered[k][i][0]))
    return orders


if __name__ == "__main__":  # python -m gpipe.measured plan.json > order.csv
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m gpipe.measured FILE > order.csv (FILE: a measured job's plan.json, or a CSV table)")
    try:
        with open(sys.argv[1], encoding="utf-8") as f:
            sys.stdout.write(write_csv(read_table(f.read(MAX_CSV_BYTES + 1))))
    except (OSError, UnicodeDecodeError, TableError) as e:
        sys.exit(f"error: {sys.argv[1]}: {e}")
