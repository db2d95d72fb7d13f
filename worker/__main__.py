"""`python -m gpipe.worker ...`: a job attempt's worker process (see worker.attempt)."""

from gpipe import proc

proc.adopt()  # first, before the seconds torch takes to import: die with the parent from the start

from gpipe.worker.attempt import main  # noqa: E402

proc.exit_now(main())
