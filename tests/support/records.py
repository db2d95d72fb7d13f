"""Job records as job.json holds them (gpipe.service.serde), for the tests of what is read back from disk."""

from __future__ import annotations

import json

from gpipe.service.job_records import JobRecord, JobState, StateChange
from tests.support.spec import DELETE

RECORD = JobRecord(
    name="j", spec_yaml="name: j\n", steps=10, state=JobState.FAILED, steps_done=4, loss=float("nan"),
    history=[StateChange(JobState.PENDING, 1.5), StateChange(JobState.FAILED, 2.5, "stage 1 raised")],
    failed_rank=1, error="stage 1 raised", output_dir="/s/j", restarts=2, attempts=3, checkpoint_step=4, exit_code=1,
)


def on_disk(**changes) -> dict:
    """RECORD as job.json holds it, with fields changed (a value of DELETE removes one)."""
    d = json.loads(json.dumps(RECORD.to_json()))
    for k, v in changes.items():
        if v is DELETE:
            del d[k]
        else:
            d[k] = v
    return d

