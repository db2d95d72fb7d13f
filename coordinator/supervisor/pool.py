"""The shared pool's policy: which waiting jobs start, on which workers and at which size, which running jobs a
waiting one preempts, which shrunk ones grow back, and which jobs the pool refuses. The one place that decides;
the supervisor (gpipe.coordinator.supervisor.core) carries it out.

- **Gang placement.** A job starts when the pool has an idle worker for every one of its slots (stages x
  replicas) at once, never a part of them; two jobs never share a worker. It takes the workers it ran on
  before (a restart or a resume), else the ranks its spec names (0 .. stages x replicas - 1), else any idle
  worker, those of one host together so that neighbouring stages are neighbours (`place`).
- **Order.** Waiting jobs are taken in priority order (the spec's `priority`, higher first), then in order of
  submission (`order`).
- **Backfill.** A job that fits starts even when one before it in the order does not (a smaller job beside
  a larger waiting one), unless that one has waited STARVE_AFTER_S or more: from then on nothing after it
  starts until it has (its workers are kept for it as they free up).
- **Priority preemption.** A job that cannot start preempts the fewest running jobs of lower priority whose
  workers, with the idle ones, make it fit (`victims`): largest first, then the lowest priority, then the
  newest. They checkpoint at their next step boundary, as on SIGTERM, wait PREEMPTED (no restart counted)
  and start again, by the same rules, once workers are free. Workers being freed that way are counted for
  the job they were freed for: it preempts no more than it needs, and nothing after it takes them.
- **Elastic sizes.** An elastic job may run at several sizes (`Waiting.sizes`: the world sizes of its shapes,
  gpipe.coordinator.plan.elastic.shapes, largest first). One that may shrink now (`Waiting.shrink`: it waited
  restart_timeout_s for lost ranks, or it was preempted for a job of higher priority, which holds its workers;
  gpipe.coordinator.supervisor.policy.when_away) and does not fit starts at the largest smaller size the idle
  workers carry (`shrink_to`) rather than wait. A shrunk job grows back to its largest size only onto the
  workers this round left free (none another job was given, none kept for a job that holds the rest back):
  one starting now takes them at once; one running ends at its next checkpoint to start again at that size
  (`Decision.grows`).
- **A job that can never fit.** With the pool's size known (`serve --max-workers N`: its workers are ranks
  0 .. N-1), a job needing more workers than that, at the least size it may start at, is refused
  (`never_fits`: at submit, and here for one queued before serve was restarted with a smaller N). Without it
  the pool may grow (workers join at any time), so such a job waits, saying how many workers it needs and how
  many are registered (`short_of`), and holds nothing back.

Pure: numbers and names in, decisions out; the tests drive it with a fake clock's waits.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

STARVE_AFTER_S = 600.0  # a job waiting this long stops backfill past it
MAX_QUEUED = 1000  # jobs waiting for workers at most: submit answers RESOURCE_EXHAUSTED past it
PREEMPT_GRACE_S = 120.0  # a preempted job's time to checkpoint at its step boundary, then it is killed
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
MIN_STARVE_AFTER_S, MAX_STARVE_AFTER_S = 1.0, 86400.0  # serve --starve-after-s's range
MAX_WORKERS = 4096  # serve --max-workers at most: ranks are 0-4095

W = TypeVar("W")


@dataclass(frozen=True)
class Limits:
    """The pool's settings (serve's flags): its size, when known, and the starvation bound."""

    max_workers: int | None = None  # the pool's workers are ranks 0 .. max_workers - 1; None: any may join
    starve_after_s: float = STARVE_AFTER_S


@dataclass(frozen=True)
class Waiting:
    name: str
    priority: int
    seq: int  # its place in submission order
    slots: int  # workers it needs at once, at the size it waits at
    waited_s: float  # since it began waiting (the starvation bound counts this)
    sizes: tuple[int, ...] = ()  # the sizes it may run at (elastic), largest first; (): `slots` only
    shrink: bool = False  # it may start at a size below `slots` now (gpipe.coordinator.supervisor.policy.when_away)

    def least(self) -> int:
        """The fewest workers it may start on now."""
        return min((s for s in self.sizes if s < self.slots), default=self.slots) if self.shrink else self.slots


@dataclass(frozen=True)
class Running:
    name: str
    priority: int
    seq: int
    ranks: tuple[int, ...]
    preempting: bool = False  # asked to stop already: its workers are on their way back
    sizes: tuple[int, ...] = ()  # as Waiting's: one running on fewer workers than the largest may grow back


@dataclass
class Decision:
    """What `decide` asks for: jobs to start (name -> the ranks of its workers, by slot: its size is their
    count), of those the ones started shrunk (name -> size, below the size it waited at); jobs to preempt
    (victim -> the job it makes room for); running jobs to grow back (name -> size: end the attempt at its next
    checkpoint, to start again at that size); and jobs refused (name -> why, one line: never_fits)."""

    starts: dict[str, list[int]] = field(default_factory=dict)
    shrinks: dict[str, int] = field(default_factory=dict)
    preempts: dict[str, str] = field(default_factory=dict)
    grows: dict[str, int] = field(default_factory=dict)
    refuses: dict[str, str] = field(default_factory=dict)
    blocked_by: str | None = None  # the job that keeps the rest waiting (starved, or preempting for)


def order(waiting: Sequence[Waiting]) -> list[Waiting]:
    """Priority first (higher first), then submission order."""
    return sorted(waiting, key=lambda w: (-w.priority, w.seq))


def place(slots: int, idle: Mapping[int, W], prefer: Sequence[int], host: Callable[[W], str]) -> list[int] | None:
    """The ranks of `slots` idle workers for a job's slots, in slot order, or None when too few are idle: the
    ranks of `prefer` (by slot) where idle; the other slots from the rest, one host's workers together (hosts
    with more idle workers first), lowest rank first within a host."""
    if len(idle) < slots:
        return None
    out: list[int | None] = [None] * slots
    taken: set[int] = set()
    for slot, rank in enumerate(list(prefer)[:slots]):
        if rank in idle and rank not in taken:
            out[slot] = rank
            taken.add(rank)
    by_host: dict[str, list[int]] = {}
    for rank in sorted(r for r in idle if r not in taken):
        by_host.setdefault(host(idle[rank]), []).append(rank)
    rest = [r for h in sorted(by_host, key=lambda h: (-len(by_host[h]), h)) for r in by_host[h]]
    it = iter(rest)
    return [r if r is not None else next(it) for r in out]


def victims(job: Waiting, idle: int, running: Sequence[Running],
            usable: Collection[int] | None = None) -> list[str] | None:
    """The fewest running jobs of lower priority whose workers, with `idle` idle ones and those being freed
    already, make `job` fit; [] when those being freed suffice; None when no choice does. `usable`: the ranks
    `job` could run on at all (its device's); a running job's other workers count for nothing, and a job
    holding none of them is never a victim (None: every rank)."""

    def useful(r: Running) -> int:
        return len(r.ranks) if usable is None else sum(1 for k in r.ranks if k in usable)

    freeing = sum(useful(r) for r in running if r.preempting)
    need = job.slots - idle - freeing
    if need <= 0:
        return []
    lower = sorted((r for r in running if not r.preempting and r.priority < job.priority and useful(r) > 0),
                   key=lambda r: (-useful(r), r.priority, -r.seq))
    out: list[str] = []
    for r in lower:
        if need <= 0:
            break
        out.append(r.name)
        need -= useful(r)
    return out if need <= 0 else None


def never_fits(name: str, slots: int, limits: Limits) -> str | None:
    """Why job `name`, needing `slots` workers at once, can never start on this pool (one line), or None: only
    when the pool's size is known; a pool that may grow has room for anything, in time."""
    if limits.max_workers is None or slots <= limits.max_workers:
        return None
    return (f"job {name!r} needs {slots} workers at once, and this pool has at most {limits.max_workers} "
            f"(serve --max-workers {limits.max_workers})")


def short_of(slots: int, registered: int, limits: Limits) -> str:
    """Why a job waits that needs more workers than are registered ('' when it does not), in a pool that may grow.
    In a pool of known size the job fits (never_fits) and its workers are on their way: nothing to say."""
    if slots <= registered or limits.max_workers is not None:
        return ""
    return f"needs {slots} workers at once, {registered} registered: waiting for more to join"


def shrink_to(sizes: Sequence[int], slots: int, available: int) -> int | None:
    """The largest of `sizes` below `slots` that `available` workers carry, or None (none is: it waits)."""
    return next((s for s in sizes if s < slots and s <= available), None)


def decide(waiting: Sequence[Waiting], idle: Mapping[int, W], running: Sequence[Running],
           prefer: Callable[[Waiting], Sequence[int]],
           fits: Callable[[Waiting | Running, Mapping[int, W]], Mapping[int, W]],
           host: Callable[[W], str], registered: Mapping[int, W], limits: Limits | None = None) -> Decision:
    """The round's decision (the module's doc). `fits(job, workers)`: those of `workers` that may take `job`
    (its device's, heard from since its last failure); `prefer(job)`: the ranks it would rather have, by slot;
    `registered`: every worker registered, busy or not. A job preempts only jobs holding workers it can use,
    and holds the rest back past the starvation bound only when there are enough of those for it (one that
    needs more waits without holding anything back); the idle workers it could use are then kept for it."""
    limits = limits or Limits()
    d = Decision()
    left = dict(idle)
    running = list(running)
    kept: set[int] = set()  # idle workers kept for the job that holds the rest back
    for job in waiting:  # every one, the jobs after one that holds the rest back too
        if (why := never_fits(job.name, job.least(), limits)) is not None:
            d.refuses[job.name] = why
    for job in order([w for w in waiting if w.name not in d.refuses]):
        mine = fits(job, left)
        ranks = place(job.slots, mine, prefer(job), host)
        if ranks is None and job.shrink and (size := shrink_to(job.sizes, job.slots, len(mine))) is not None:
            ranks = place(size, mine, prefer(job), host)
            d.shrinks[job.name] = size
        if ranks is not None:
            d.starts[job.name] = ranks
            for r in ranks:
                del left[r]
            continue
        usable = fits(job, registered)  # every worker it could ever run on: its device's
        chosen = victims(job, len(mine), running, usable.keys())
        if chosen is not None:  # it will fit once they are stopped: the idle ones stay for it
            for name in chosen:
                d.preempts[name] = job.name
            running = [r if r.name not in chosen else Running(r.name, r.priority, r.seq, r.ranks, True, r.sizes)
                       for r in running]
            d.blocked_by, kept = job.name, set(mine)
            break
        if job.waited_s >= limits.starve_after_s and job.slots <= len(usable):
            d.blocked_by, kept = job.name, set(mine)
            break
    _grow(d, waiting, running, {r: w for r, w in left.items() if r not in kept}, fits, host)
    return d


def _grow(d: Decision, waiting: Sequence[Waiting], running: Sequence[Running], free: Mapping[int, W],
          fits: Callable[[Waiting | Running, Mapping[int, W]], Mapping[int, W]], host: Callable[[W], str]) -> None:
    """Shrunk jobs back at their largest size, in the pool's order, onto the `free` workers (those the round
    left, none kept for a job that holds the rest back): one started this round (not shrunk in it) takes them
    now; one running (not being preempted) is told to grow at its next checkpoint, and they are counted for it."""
    free = dict(free)
    shrunk: list[Waiting | Running] = [w for w in waiting if w.name in d.starts and w.name not in d.shrinks]
    shrunk += [r for r in running if not r.preempting and r.name not in d.preempts]
    for job in sorted(shrunk, key=lambda j: (-j.priority, j.seq)):
        have = d.starts[job.name] if isinstance(job, Waiting) else list(job.ranks)
        if not job.sizes or len(have) >= job.sizes[0]:
            continue
        more = place(job.sizes[0] - len(have), fits(job, free), [], host)
        if more is None:
            continue
        for r in more:
            del free[r]
        if isinstance(job, Waiting):
            d.starts[job.name] = have + more
        else:
            d.grows[job.name] = job.sizes[0]
