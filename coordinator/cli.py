"""gpipe-coordinator: run a pipeline-parallel training job.

    gpipe-coordinator run examples/charlm.yaml              # train on this machine
    gpipe-coordinator run job.yaml --state-dir /data/gpipe  # outputs in /data/gpipe/<name>/
    gpipe-coordinator validate job.yaml                     # check a spec, start nothing
    gpipe-coordinator timeline gpipe-state/charlm --step 5  # draw step 5 of a run

Exit codes: 0 done, 1 the job failed (the failing stage is named), 2 bad input
(spec, flag or file; nothing was started), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from pathlib import Path

from gpipe.errors import EXIT_BAD_INPUT, EXIT_FAILED, GpipeError

DEFAULT_STATE_DIR = "gpipe-state"
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as for a bad spec
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpipe-coordinator", description="Pipeline-parallel training of one PyTorch model.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="train a job on this machine with local worker processes")
    run.add_argument("job", help="the job spec (YAML)")
    run.add_argument(
        "--state-dir", default=os.environ.get("GPIPE_STATE_DIR", DEFAULT_STATE_DIR),
        help=f"where <name>/ outputs go (env GPIPE_STATE_DIR; default ./{DEFAULT_STATE_DIR})",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    val = sub.add_parser("validate", help="check a job spec and its model and data; start nothing")
    val.add_argument("job")
    tl = sub.add_parser("timeline", help="draw a logged step: <job dir>/trace.json and timeline.png")
    tl.add_argument("job_dir", help="the job's output directory, <state-dir>/<name>")
    tl.add_argument("--step", type=int, default=None, help="the step to draw (default: the last logged)")
    return p


def _on_sigterm(signum, frame):  # noqa: ANN001
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    warnings.filterwarnings("ignore", message="You are using a Backend")
    signal.signal(signal.SIGTERM, _on_sigterm)
    # Imported here so that `--help` and flag errors answer at once.
    from coordinator.local_run import run_local
    from coordinator.plan import make_plan
    from coordinator.spec import load_spec

    try:
        if args.command == "timeline":
            from coordinator import timeline

            trace, png = timeline.write(Path(args.job_dir), args.step)
            print(f"{trace}\n{png}")
            return 0
        spec = load_spec(args.job)
        job_dir = Path(args.job).resolve().parent
        if args.command == "validate":
            plan = make_plan(spec, job_dir)
            print(f"{args.job}: ok ({len(plan.model)} layers, balance {plan.balance})")
            return 0
        run_local(spec, job_dir, Path(args.state_dir), progress=not args.no_progress)
        return 0
    except GpipeError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as e:  # a bug of ours: one line, and the traceback on request
        if os.environ.get("GPIPE_DEBUG"):
            raise
        print(f"error: internal error: {type(e).__name__}: {e} (GPIPE_DEBUG=1 shows the traceback)",
              file=sys.stderr, flush=True)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
