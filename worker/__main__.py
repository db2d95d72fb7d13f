"""`python -m worker ...`: a job attempt's worker process (see worker.attempt)."""

import sys

from worker.attempt import main

sys.exit(main())
