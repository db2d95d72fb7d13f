"""`python -m worker ...`: a job attempt's worker process (see worker.attempt)."""

import sys

from gpipe import proc

proc.adopt()  # first, before the seconds torch takes to import: die with the parent from the start

import os  # noqa: E402

from worker.attempt import main  # noqa: E402

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # nothing is left to write: skip the second or so torch's interpreter teardown takes
