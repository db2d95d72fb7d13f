"""Where an action's own cost goes, statement by statement: F and B of the 2-stage service, from inside the workers.

    python bench/action_lines.py [--rounds 2] [--steps 30] [--width 1024] [--checkout DIR]

The job is bench/action_cost.py's (4 x (Linear(1024)+ReLU) a stage, 2 stages,
1f1b, batch 256 in 8 micro-batches of 32, `gpipe-coordinator run`, one core a
worker). A probe in each worker (a sitecustomize, as action_cost's PROBE)
recompiles gpipe.stage.Stage's `_forward`, `_backward` and `_compute`, and
gpipe.rng.seeded_forward, from their source with a clock read before each of
their top-level statements, and reads the clock around each layer's call
(the stage's layers each in a marking call, wherever the engine calls them:
seeded_forward, or `_compute`'s own loop when no layer is seeded), and nothing
else (bench/README.md (ab)). A clock read costs some
0.1 us; each statement's figure is the median over every action of every step
after the third, in us. The statement that holds the blocks (F's `if p.train:`,
B's `if p.split:`) and a wait for a neighbour (stage 1's `if self.first:`, stage
0's `if any(wants):`) show their whole time: the rest is the engine's own. F's
`if p.train:` is the time from that statement to its first layer's call; each
layer's figure, its call; the figure after it, the engine's time to the next
layer's call or the next statement (a call of the probe's own a layer, some
1-2 us, is in it).
"""

from __future__ import annotations

import argparse
import ast
import collections
import inspect
import statistics
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from action_cost import service  # noqa: E402
from step_time import WIDTH  # noqa: E402

# The probe: `SOURCES` (the marked functions' source, by action) is filled in below.
PROBE = r'''
import json, os, time
OUT = os.environ.get("GPIPE_BENCH_PROBE")
if OUT:
    import gpipe.rng as rng
    import gpipe.stage as st
    SOURCES = {sources!r}
    _M = []
    for mod in (st, rng):
        mod._M, mod._clock = _M, time.perf_counter
    clock = time.perf_counter
    for name, src in SOURCES.items():
        exec(compile(src, "bench-" + name, "exec"), (rng if name == "seeded_forward" else st).__dict__)
    st.Stage._forward, st.Stage._backward = st._marked_forward, st._marked_backward
    st.Stage._compute = st._marked_compute
    forward = rng._marked_seeded_forward

    def marked(n, layer):
        def call(v):
            _M.append(("layer %d" % n, clock()))
            out = layer(v)
            _M.append(("after layer %d" % n, clock()))
            return out
        return call

    def seeded_forward(layers, x, seed, step, micro_batch, shared=None, seeded=None):
        args = [layers, x, seed, step, micro_batch, shared]  # (its layers marked: the stage's, below)
        return forward(*args) if seeded is None else forward(*args, seeded)  # (an engine that seeds every layer)
    st.seeded_forward = seeded_forward

    def action(f, kind):
        def run(self, mb, p):
            _M.clear()
            f(self, mb, p)
            _M.append(("end", clock()))
            self._probe_got.append((kind, p.computing_from, list(_M)))
        return run
    st.Stage.ACTIONS = dict(st.Stage.ACTIONS, F=action(st.Stage._forward, "F"), B=action(st.Stage._backward, "B"))
    run = st.Stage.run

    def timed_run(self, actions, positions, p, t_start):
        if not getattr(self, "_marked", False):  # each layer's call marked, wherever the engine calls it
            self._marked = True
            self.indexed = [(i, marked(n, m)) for n, (i, m) in enumerate(self.indexed)]
        self._probe_got = []
        run(self, actions, positions, p, t_start)
        rows = [(self.cfg.model_chunk, kind, [(name, t - t0) for name, t in m]) for kind, t0, m in self._probe_got]
        with open(os.path.join(OUT, f"{{os.getpid()}}.jsonl"), "a") as f:
            f.write(json.dumps(rows) + "\n")
    st.Stage.run = timed_run
'''


def marked(fn: object, name: str, prefix: str = "") -> str:
    """`fn`'s source as a module-level function `name`, a clock read (naming the statement) before each of its
    top-level statements (found by `ast`, past the docstring). The reads record the time each
    statement starts: a statement's figure is the next read's time less its own."""
    source = textwrap.dedent(inspect.getsource(fn))  # type: ignore[arg-type]
    tree = ast.parse(source).body[0]
    if not isinstance(tree, ast.FunctionDef):
        raise TypeError(f"{fn!r} is not a function")
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    lines = source.splitlines()
    starts = {stmt.lineno - 1: lines[stmt.lineno - 1].strip() for stmt in body}
    indent = " " * tree.body[0].col_offset
    out = []
    for i, line in enumerate(lines[tree.lineno - 1:], tree.lineno - 1):  # (past any decorator)
        if i in starts:
            out.append(f"{indent}_M.append(({(prefix + starts[i])[:72]!r}, _clock()))")
        out.append(line)
    out[0] = out[0].replace(f"def {tree.name}(", f"def {name}(", 1)
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--width", type=int, default=WIDTH)
    ap.add_argument("--checkout", type=Path, help="another checkout, set up (make setup): its engine, profiled")
    a = ap.parse_args()
    if a.checkout is not None:
        sys.path.insert(0, str(a.checkout))
        for m in [m for m in sys.modules if m == "gpipe" or m.startswith("gpipe.")]:
            del sys.modules[m]
    from gpipe import rng, stage

    sources = {"F": marked(stage.Stage._forward, "_marked_forward"),
               "B": marked(stage.Stage._backward, "_marked_backward"),
               "_compute": marked(stage.Stage._compute, "_marked_compute", "_compute: "),
               "seeded_forward": marked(rng.seeded_forward, "_marked_seeded_forward", "seeded_forward: ")}
    code = PROBE.replace("{{", "{").replace("}}", "}").replace("{sources!r}", repr(sources))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.rounds):
            rows += service(2, a.steps, Path(d), a.width, a.checkout, probe=True, probe_code=code)["probe_rows"]
    print(f"F and B of one micro-batch ({a.width} wide) on each of 2 stages, by statement (us, medians over "
          f"{a.rounds} rounds' actions); * holds the blocks or a wait")
    for k in range(2):
        for kind in ("F", "B"):
            paths = collections.Counter(tuple(name for name, _ in m) for s, x, m in rows if (s, x) == (k, kind))
            if not paths:
                continue
            names, count = paths.most_common(1)[0]  # (a recomputed forward takes another path: its own marks)
            marks = [m for s, x, m in rows if (s, x) == (k, kind) and tuple(name for name, _ in m) == names]
            others = sum(paths.values()) - count
            print(f"\nstage {k} {kind} ({count} actions" + (f"; {others} that took other paths left out)" if others
                                                            else ")"))
            for i, name in enumerate(names[:-1]):
                v = statistics.median(m[i + 1][1] - m[i][1] for m in marks) * 1e6
                star = "*" if v > 500 else " "
                print(f"  {v:9.1f}{star} {name}")


if __name__ == "__main__":
    main()
