"""Job records read back from disk: every one accepted goes on the wire; any other is one line."""

from __future__ import annotations

import dataclasses

import pytest

from gpipe.service import job_records, serde
from gpipe.service.job_records import INT32, INT64, JobRecord, JobState, StateChange
from tests.support.records import RECORD, on_disk
from tests.support.spec import DELETE


def test_a_record_reads_back_as_written():
    back = JobRecord.from_json(on_disk())
    assert back.history == RECORD.history and back.state is JobState.FAILED
    assert dataclasses.replace(back, loss=0.0) == dataclasses.replace(RECORD, loss=0.0)  # nan != nan
    assert serde.job_to_pb(back).steps == 10


def test_an_older_record_takes_defaults():
    d = {"name": "j", "spec_yaml": "", "steps": 3, "state": "PENDING"}
    assert JobRecord.from_json(d) == JobRecord(name="j", spec_yaml="", steps=3)


def test_every_field_has_a_check():
    assert set(job_records._RECORD_FIELDS) == {f.name for f in dataclasses.fields(JobRecord)}
    assert set(job_records._CHANGE_FIELDS) == {f.name for f in dataclasses.fields(StateChange)}


BAD = [
    # (job.json as a person may have edited it, the start of the line)
    (on_disk(steps="twenty"), "steps: must be an integer between 0 and 9223372036854775807, got 'twenty'"),
    (on_disk(steps=10**30), "steps: must be an integer between 0 and 9223372036854775807, got 1e+30"),
    (on_disk(steps=INT64[1] + 1), "steps: must be an integer"),
    (on_disk(steps=2.0), "steps: must be an integer"),
    (on_disk(steps=True), "steps: must be an integer"),
    (on_disk(steps=-1), "steps: must be an integer"),
    (on_disk(steps=DELETE), "steps: required field is missing"),
    (on_disk(name=DELETE), "name: required field is missing"),
    (on_disk(state=DELETE), "state: required field is missing"),
    (on_disk(state="BOGUS"), "state: must be one of PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED, RESTARTING, PREEMPTED, got 'BOGUS'"),
    (on_disk(state=2), "state: must be one of"),
    (on_disk(restarts=INT32[1] + 1), "restarts: must be an integer between 0 and 2147483647, got 2147483648"),
    (on_disk(attempts=None), "attempts: must be an integer between 0 and 2147483647, got null"),
    (on_disk(failed_rank=-2), "failed_rank: must be an integer between -1 and 2147483647"),
    (on_disk(checkpoint_step=[]), "checkpoint_step: must be an integer"),
    (on_disk(steps_done={}), "steps_done: must be an integer"),
    (on_disk(exit_code=256), "exit_code: must be an integer between 0 and 255"),
    (on_disk(loss="low"), "loss: must be a number, got 'low'"),
    (on_disk(loss=10**400), "loss: must be a number a double holds"),
    (on_disk(name=5), "name: must be text, got 5"),
    (on_disk(spec_yaml=None), "spec_yaml: must be text, got null"),
    (on_disk(error="\ud800"), "error: not valid UTF-8 text"),
    (on_disk(extra=1), "job record: unknown field 'extra'"),
    (on_disk(history={}), "history: must be a list"),
    (on_disk(history=[5]), "history.0: must be an object, got 5"),
    (on_disk(history=[{"state": "PENDING", "time_unix": 1.0}, {"state": "GONE", "time_unix": 1.0}]), "history.1.state: must be one of"),
    (on_disk(history=[{"state": "PENDING"}]), "history.0.time_unix: required field is missing"),
    (on_disk(history=[{"state": "PENDING", "time_unix": "now"}]), "history.0.time_unix: must be a number, got 'now'"),
    (on_disk(history=[{"state": "PENDING", "time_unix": float("inf")}]), "history.0.time_unix: must be a finite number"),
    (on_disk(history=[{"state": "PENDING", "time_unix": 1, "message": 7}]), "history.0.message: must be text"),
    (on_disk(history=[{"state": "PENDING", "time_unix": 1, "by": "x"}]), "history.0: unknown field 'by'"),
    ([], "job record: must be an object, got []"),
    ("job", "job record: must be an object, got 'job'"),
    (None, "job record: must be an object, got null"),
]


@pytest.mark.parametrize("d,message", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_a_bad_record_is_one_line_naming_the_field(d, message):
    with pytest.raises(ValueError) as e:
        JobRecord.from_json(d)
    line = str(e.value)
    assert type(e.value) is ValueError and "\n" not in line
    assert line.startswith(message), line


def test_the_largest_record_goes_on_the_wire():
    big = on_disk(steps=INT64[1], steps_done=INT64[1], checkpoint_step=INT64[1], restarts=INT32[1],
                  attempts=INT32[1], failed_rank=INT32[1], loss=float("inf"))
    m = serde.job_to_pb(JobRecord.from_json(big))
    assert (m.steps, m.restarts) == (INT64[1], INT32[1])
