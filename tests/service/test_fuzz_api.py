"""Every JobService and WorkerService method, fuzzed against a real serve: never UNKNOWN or INTERNAL.

Hypothesis sends arbitrary strings and integers in every field (a bounded,
fixed number of examples, the same on every run); serve must answer each one
with a status that says what happened, and stay healthy.
"""

from __future__ import annotations

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpipe.service.v1 import jobs_pb2 as J
from gpipe.service.v1 import jobs_pb2_grpc, workers_pb2_grpc
from gpipe.service.v1 import workers_pb2 as W
from tests.support.cli import Cli, end_leftovers
from tests.support.service import Service
from tests.support.spec import SERVICE, job

CLIENT, WORKER = "client-fuzz", "worker-fuzz"
BROKEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
          grpc.StatusCode.DEADLINE_EXCEEDED}
FUZZ = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

int32 = st.integers(-(2**31), 2**31 - 1)
text = st.one_of(st.text(max_size=80), st.text(max_size=2000), st.sampled_from(["", "kept", "..", "a" * 64]))
# A JSON-like value for a spec field: numbers at the edges, strings, lists, maps.
value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=40)),
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=20,
)
# A spec with one field replaced; its name is not a job name, so none reaches validation (or the queue).
spec_fields = sorted(set(job(SERVICE, name="x")) - {"name"}) + ["colour", "max_restarts", "start_timeout_s", "checkpoint_every"]
mutated = st.builds(lambda k, v: yaml.safe_dump(job(SERVICE, name="-fuzz") | {k: v}), st.sampled_from(spec_fields), value)
spec_yaml = st.one_of(text, mutated, st.builds(yaml.safe_dump, value))


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    c = Cli(tmp_path_factory.mktemp("fuzz"))
    s = Service(c)
    s.env.update(GPIPE_TOKEN=CLIENT, GPIPE_WORKER_TOKEN=WORKER)
    try:
        s.start_serve()
        with grpc.insecure_channel(s.address) as ch:
            yield s, jobs_pb2_grpc.JobServiceStub(ch), workers_pb2_grpc.WorkerServiceStub(ch)
    finally:
        s.stop_all()
        left = end_leftovers(c)
    assert not left, f"processes left behind: {left}"


def status(fn, request, token: str) -> grpc.StatusCode:
    """The status of one call (a stream: of its first message)."""
    try:
        r = fn(request, metadata=[("authorization", f"Bearer {token}")], timeout=30)
        if not hasattr(r, "SerializeToString"):  # a stream
            next(r, None)
            r.cancel()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        assert e.code() not in BROKEN, f"{e.code().name}: {e.details()}"
        return e.code()


@pytest.mark.multiprocess
@FUZZ
@given(spec_yaml)
def test_submit(stubs, spec_yaml):
    assert status(stubs[1].SubmitJob, J.SubmitJobRequest(spec_yaml=spec_yaml), CLIENT) != grpc.StatusCode.OK


@pytest.mark.multiprocess
@FUZZ
@given(st.sampled_from(["GetJob", "StopJob", "ResumeJob", "WatchJob"]), text)
def test_job_by_name(stubs, method, name):
    request = getattr(J, f"{method}Request")(name=name)
    assert status(getattr(stubs[1], method), request, CLIENT) in (grpc.StatusCode.INVALID_ARGUMENT,
                                                                  grpc.StatusCode.NOT_FOUND)


@pytest.mark.multiprocess
@FUZZ
@given(st.one_of(st.sampled_from([CLIENT, WORKER]), st.text(st.characters(min_codepoint=33, max_codepoint=126))))
def test_list_with_any_token(stubs, token):
    got = status(stubs[1].ListJobs, J.ListJobsRequest(), token)
    assert (got == grpc.StatusCode.OK) == (token == CLIENT), got


@pytest.mark.multiprocess
@FUZZ
@given(int32, text, text, text, st.lists(int32, max_size=64), int32)
def test_register(stubs, rank, host, device, hostname, cores, threads):
    request = W.RegisterRequest(rank=rank, host=host, device=device, hostname=hostname, cores=cores,
                                threads=threads)
    status(stubs[2].Register, request, WORKER)


@pytest.mark.multiprocess
@FUZZ
@given(text, text, int32, st.booleans(), text)
def test_heartbeat(stubs, worker_id, attempt_id, code, ended, error):
    request = W.HeartbeatRequest(worker_id=worker_id, attempt_id=attempt_id, attempt_exit=code,
                                 attempt_ended=ended, attempt_error=error)
    status(stubs[2].Heartbeat, request, WORKER)


@pytest.mark.multiprocess
@FUZZ
@given(text)
def test_commands(stubs, worker_id):
    assert status(stubs[2].Commands, W.CommandsRequest(worker_id=worker_id), WORKER) != grpc.StatusCode.OK


@pytest.mark.multiprocess
def test_serve_is_healthy_after_the_fuzz(stubs):
    s = stubs[0]
    with grpc.insecure_channel(s.address) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert "Traceback" not in s.log("serve")
    assert not s.state.exists() or not list(s.state.iterdir())  # no request made a job
