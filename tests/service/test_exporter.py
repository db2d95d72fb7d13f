"""serve --metrics-port: a real serve and workers train a job, then Prometheus' /metrics is scraped and parsed."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpipe.coordinator.attempt import report
from gpipe.coordinator.server.exporter import MAX_ENDED_JOBS, Exporter
from gpipe.service.job_records import JobState
from tests.support.harness import Harness
from tests.support.ports import free_port, free_port_in
from tests.support.service import Service
from tests.support.spec import SERVICE, job

HANDED: set[int] = set()  # ports handed out already (free until their server binds them)


def port() -> int:
    """A free port: in GPIPE_TEST_PORTS (FIRST-LAST) when set, else any the system gives."""
    span = os.environ.get("GPIPE_TEST_PORTS")
    if not span:
        return free_port()
    first, last = map(int, span.split("-"))
    p = free_port_in(range(first, last + 1), HANDED)
    HANDED.add(p)
    return p


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """Every sample of /metrics, by its name, then its label values in order."""
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        return samples(r.read().decode())


def samples(text: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(s.labels.values())] = s.value
    return out


@pytest.mark.multiprocess
def test_a_scrape_shows_the_jobs_and_workers(cli):
    s = Service(cli)
    s.port = port()
    s.address = f"127.0.0.1:{s.port}"
    metrics_port = port()
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        s.start_serve("--metrics-port", str(metrics_port))
        got = scrape(url)
        assert got["gpipe_jobs"] == {(state,): 0 for state in
                                     ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED", "RESTARTING", "PREEMPTED")}
        assert got["gpipe_workers"] == {("idle",): 0, ("busy",): 0, ("lost",): 0}
        s.start_worker(0)
        s.start_worker(1)
        spec = job(SERVICE, name="scraped", steps=5, checkpoint_every=2)
        r = s.client("submit", str(cli.write(spec)), "--follow")
        assert r.returncode == 0, r.stderr + s.log("serve")

        got = scrape(url)
        lines = [json.loads(x) for x in (s.state / "scraped" / "metrics.jsonl").read_text().splitlines()]
        last = lines[-1]
        assert got["gpipe_jobs"][("SUCCEEDED",)] == 1 and sum(got["gpipe_jobs"].values()) == 1
        assert last["step"] == 4 and got["gpipe_job_step"] == {("scraped",): 5}  # steps done
        assert got["gpipe_job_loss"] == {("scraped",): last["loss"]}
        assert got["gpipe_job_samples_per_second"] == {("scraped",): last["samples_per_s"]}
        assert got["gpipe_job_bubble_fraction"] == {("scraped",): last["bubble_fraction"]}
        assert got["gpipe_job_restarts_total"] == {("scraped",): 0}
        assert 0 <= got["gpipe_job_checkpoint_age_seconds"][("scraped",)] < 60
        assert got["gpipe_workers"] == {("idle",): 2, ("busy",): 0, ("lost",): 0}
        assert set(got["gpipe_worker_heartbeat_age_seconds"]) == {("0",), ("1",)}
        assert all(0 <= age < 5 for age in got["gpipe_worker_heartbeat_age_seconds"].values())

        # Only GET /metrics is answered; a request head past the bound is refused, and serve goes on.
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/", timeout=30)
        assert e.value.code == 404
        huge = urllib.request.Request(url, headers={"X-Pad": "x" * 20000})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(huge, timeout=30)
        assert e.value.code == 431
        assert scrape(url)["gpipe_jobs"][("SUCCEEDED",)] == 1

        # A taken metrics port: one line naming it, exit 2, as for a taken --port.
        r = cli.run("serve", "--port", str(port()), "--state-dir", str(cli.tmp / "other"),
                    "--metrics-port", str(metrics_port), timeout=60)
        assert r.returncode == 2 and "--metrics-port" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        s.stop_all()


async def test_workers_busy_and_lost_restarts_and_bounded_job_labels():
    """In process, with the supervisor's own tests' harness: what a scrape says as a job runs, loses a worker
    and waits for it; and ended jobs beyond the newest MAX_ENDED_JOBS get no series."""
    h = Harness()
    metrics = Exporter(h.sup)

    def scraped() -> dict[str, dict[tuple, float]]:
        return samples(generate_latest(metrics.registry).decode())

    job = h.submit("j")
    h.register(0, 1)
    await h.settle()
    assert job.state == JobState.RUNNING
    got = scraped()
    assert got["gpipe_workers"] == {("idle",): 0, ("busy",): 2, ("lost",): 0}
    assert got["gpipe_job_step"] == {("j",): 0} and "gpipe_job_loss" not in got  # no step logged yet
    h.attempts[0].queue.put_nowait(report.Metrics({"step": 1, "loss": 0.25, "samples_per_s": 80.0,
                                                   "bubble_fraction": 0.5}))
    await h.settle()
    h.clock.advance(3)
    h.beat(0)
    got = scraped()
    assert got["gpipe_job_step"] == {("j",): 2} and got["gpipe_job_loss"] == {("j",): 0.25}
    assert got["gpipe_job_samples_per_second"] == {("j",): 80.0}
    assert got["gpipe_job_bubble_fraction"] == {("j",): 0.5}
    assert got["gpipe_worker_heartbeat_age_seconds"] == {("0",): 0.0, ("1",): 3.0}

    h.sup.drop(h.workers[1], "stage 1's worker missed its heartbeats")  # its attempt fails; the job waits
    await h.settle()
    assert job.state == JobState.RESTARTING
    got = scraped()
    assert got["gpipe_workers"] == {("idle",): 1, ("busy",): 0, ("lost",): 1}
    assert got["gpipe_job_restarts_total"] == {("j",): 1}
    assert got["gpipe_jobs"][("RESTARTING",)] == 1
    assert set(got["gpipe_worker_heartbeat_age_seconds"]) == {("0",)}

    for n in range(MAX_ENDED_JOBS + 5):
        h.submit(f"old{n}")
        h.clock.advance(1)
        await h.sup.stop(f"old{n}")
    got = scraped()
    assert got["gpipe_jobs"][("STOPPED",)] == MAX_ENDED_JOBS + 5
    shown = {labels[0] for labels in got["gpipe_job_step"]}
    assert shown == {"j"} | {f"old{n}" for n in range(5, MAX_ENDED_JOBS + 5)}  # the newest ended, and j
