"""The data plane's trust boundary: keys under the attempt's secret, ports on the chosen address only and
alive only for their attempt, and a malformed packet that may fail an attempt but never hangs it."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest

from gpipe.coordinator.attempt import report
from gpipe.service import job_records, net, serde
from tests.support.cli import Cli, process_kind, tagged_pids, wait_for
from tests.support.service import Service
from tests.support.spec import job, regression, slow_mlp

SLOW = slow_mlp(8, 0.02)
SECRET = re.compile(r"[0-9a-f]{32}")


# A long, slow job: an attempt lives long enough to be probed; one restart allowed.
LONG = {
    "name": "dp", "model": SLOW, "balance": [2, 2], "data": regression(32, 8, 4), "steps": 200,
    "checkpoint_every": 10, "max_restarts": 1, "step_timeout_s": 20, "start_timeout_s": 30,
}


# -- what a process listens on ----------------------------------------------------------------


def _address(hex_addr: str) -> str:
    if len(hex_addr) == 8:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_addr, 16)))
    words = [struct.pack("<I", int(hex_addr[i:i + 8], 16)) for i in range(0, 32, 8)]
    return socket.inet_ntop(socket.AF_INET6, b"".join(words))


def _listeners() -> dict[str, tuple[str, int]]:
    """Every listening TCP socket of this network namespace: inode -> (address, port)."""
    found = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                addr, port = f[1].split(":")
                found[f[9]] = (_address(addr), int(port, 16))
    return found


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on: the table above joined with its fds."""
    table = _listeners()
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:[") and target[8:-1] in table:
                found.add(table[target[8:-1]])
    return found


def attempt_ports(tag: str) -> dict[int, tuple[str, set[tuple[str, int]]]]:
    """The attempt processes carrying `tag` that listen: pid -> ('coordinator' or 'worker', what they listen on).

    Not serve, the worker daemons, or a spare attempt process (it waits for its join, listening nowhere).
    """
    found = {}
    for pid in tagged_pids(tag):
        with contextlib.suppress(OSError):  # it ended meanwhile
            if (kind := process_kind(pid)) and (addrs := listening(pid)):
                found[pid] = (kind, addrs)
    return found


def ports_of(found: dict[int, tuple[str, set[tuple[str, int]]]]) -> set[tuple[str, int]]:
    return set().union(*(addrs for _, addrs in found.values()))


def steps_done(out: Path) -> int:
    m = out / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.exists() else 0


# -- the secret ----------------------------------------------------------------------------------


def test_the_secret_travels_in_join_and_master_and_never_in_a_repr():
    secret = net.new_secret()
    assert SECRET.fullmatch(secret) and secret != net.new_secret()
    j = job_records.Join("a1", "10.0.0.5:1234", 1, 2, 30.0, secret)
    assert serde.command_from_pb(serde.command_to_pb(j)) == j
    m = report.Master("10.0.0.5:1234", secret)
    assert report.decode(report.encode(m)) == m
    assert secret not in repr(j) and secret not in repr(m)
    # A Master report without its secret is not a Master, so no worker is told to join without one.
    assert isinstance(report.decode('{"type": "Master", "address": "10.0.0.5:1234"}'), report.Log)
    for bad in ("", "xyz", "A" * 32, "0" * 31):
        with pytest.raises(ValueError):
            net.use_secret(bad)


def _stranger(host: str, port: int):
    """A plain TCPStore client: what anyone who reaches the port can open."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=3))


def test_every_key_lives_under_the_secret_and_a_strangers_keys_are_not_ours():
    import torch.distributed as dist

    secret = net.new_secret()
    net.use_secret(secret)
    store, port = net.bound_store("127.0.0.1", 10)
    assert listening(os.getpid()) >= {("127.0.0.1", port)}
    net.client_store("127.0.0.1", port, 10).set("ours", "1")
    stranger = _stranger("127.0.0.1", port)
    stranger.set("theirs", "x")
    assert store.get("ours") == b"1" and not store.check(["theirs"])
    with pytest.raises(dist.DistStoreError):
        stranger.get("ours")
    # TCPStore has no authentication, and lists its keys to anyone: the secret hides nothing from a stranger
    # on the network. That is why the ports must stay on the cluster network (docs/security.md: the trust boundary).
    assert sorted(stranger.list_keys()) == sorted([f"{secret}/ours", "theirs"])


# -- a real job ----------------------------------------------------------------------------------


def store_port(log: Path, attempt: int = 1) -> int:
    """The rendezvous store's port of `attempt`, from the coordinator's log."""
    m = re.search(rf"attempt {attempt}: rendezvous store on [^\s]+:(\d+)", log.read_text())
    assert m, f"no store port in {log}"
    return int(m.group(1))


@pytest.mark.multiprocess
def test_run_listens_on_loopback_only_keys_under_one_secret_and_every_port_closes_with_the_job(cli):
    path = cli.write(job(LONG, steps=60, max_restarts=0))
    out = cli.tmp / "state" / "dp"
    with cli.running("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress") as p:
        wait_for(lambda: steps_done(out) >= 2, 120, "two steps")
        found = attempt_ports(cli.tag)
        assert sorted(kind for kind, _ in found.values()) == ["coordinator", "worker", "worker"], found
        assert {a for a, _ in ports_of(found)} == {"127.0.0.1"}, found
        # The store holds the job's keys under one secret, which no process's command line shows.
        port = store_port(out / "logs" / "coordinator.log")
        assert ("127.0.0.1", port) in ports_of(found)
        prefixes = {k.split("/")[0] for k in _stranger("127.0.0.1", port).list_keys()}
        assert len(prefixes) == 1 and SECRET.fullmatch(secret := prefixes.pop()), prefixes
        for pid in tagged_pids(cli.tag):
            with contextlib.suppress(OSError):
                assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        _, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    assert not any(secret in f.read_text(errors="replace") for f in out.rglob("*.log"))
    still = ports_of(found) & set(_listeners().values())
    assert not still, f"still listening after the job ended: {still}"


class HostService(Service):
    """serve and its workers with every port on `host` (--host)."""

    def __init__(self, cli: Cli, host: str):
        super().__init__(cli)
        self.host, self.address = host, f"{host}:{self.port}"

    def _spawn(self, key: str, args: list[str]):
        return super()._spawn(key, [*args, "--host", self.host])


@pytest.mark.multiprocess
def test_serve_and_workers_listen_on_the_cluster_address_only_and_only_while_the_attempt_lives(cli):
    """With a non-loopback address (eth0's, say), nothing of an attempt listens on loopback or everywhere."""
    host = next((ip for name, ip in net.interfaces().items() if not ip.startswith("127.")), None)
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    s = HostService(cli, host)
    try:  # the cli fixture then checks that nothing is left
        s.start_serve("--insecure")  # no tokens in this test: a non-loopback address must be asked for
        s.start_worker(0)
        s.start_worker(1)
        r = s.client("submit", str(cli.write(job(LONG, name="wide", steps=60, max_restarts=0))))
        assert r.returncode == 0, r.stderr
        out = s.state / "wide"
        s.wait_for(lambda: steps_done(out) >= 2, "two steps", timeout=120)
        found = attempt_ports(cli.tag)
        assert sorted(kind for kind, _ in found.values()) == ["coordinator", "worker", "worker"], found
        assert {a for a, _ in ports_of(found)} == {host}, found
        s.wait_for(lambda: "SUCCEEDED" in s.client("status", "wide").stdout, "the job to succeed", timeout=180)
        # serve and the daemons are still up; the attempt's ports are gone with it.
        s.wait_for(lambda: not ports_of(found) & set(_listeners().values()), "the attempt's ports to close", 10)
        assert all(p.poll() is None for p in s.procs.values())
    finally:
        s.stop_all()


# -- strangers' packets ----------------------------------------------------------------------------

GARBAGE = bytes.fromhex("deadbeef") * 6  # 24 bytes: TensorPipe reads a length out of them and aborts


def _hit(host: str, port: int, mode: str) -> str:
    """Send one stranger's packet to host:port; what became of it."""
    try:
        with socket.create_connection((host, port), timeout=2) as s:
            if mode == "garbage":
                s.sendall(GARBAGE)
                time.sleep(0.2)
        return "sent"
    except OSError as e:  # the process it belonged to died of an earlier packet
        return type(e).__name__


def _meddle(host: str, port: int) -> None:
    """A stranger's TCPStore requests, for keys outside the secret: torch's own names, unprefixed."""
    import torch.distributed as dist

    st = _stranger(host, port)
    st.set("rpc_prefix_0/coordinator", "10.6.6.6:1")
    st.add("rpc_prefix_0/shutdown_counter", 100)
    st.delete_key("default_pg/0//cpu//0")
    with pytest.raises(dist.DistStoreError):
        st.get("default_pg/0//cpu//1")  # no such key outside the namespace: waits its 3 s, then gives up


def _attempt_started(out: Path, n: int) -> bool:
    m = out / "metrics.jsonl"
    return m.exists() and f'"attempt": {n}' in m.read_text()


def _ends_by_itself(p, timeout: float) -> str:
    """`p`'s stderr once it ended; a job still running after `timeout` seconds hangs (the block then kills it)."""
    try:
        return p.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job was still running {timeout:.0f}s after the packets: it hangs")


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["garbage", "close+store"])
def test_a_strangers_packet_may_fail_the_attempt_but_never_hangs_the_job(cli, mode):
    """Mid-run, every port of the attempt gets garbage; or a connect-and-close, and the store gets requests."""
    path = cli.write(job(LONG, steps=60))  # hit after 3 steps: the rest is for a restart to finish, or none
    out = cli.tmp / "state" / "dp"
    with cli.running("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress") as p:
        wait_for(lambda: steps_done(out) >= 3, 120, "three steps")
        found = attempt_ports(cli.tag)
        port = store_port(out / "logs" / "coordinator.log")
        t0 = time.monotonic()
        hits = {a: _hit(*a, mode.split("+")[0]) for a in sorted(ports_of(found))}
        if mode.endswith("+store"):
            _meddle("127.0.0.1", port)
            hits[("127.0.0.1", port)] = "sent"
        restarted = None
        while p.poll() is None and time.monotonic() - t0 < 150:
            if restarted is None and _attempt_started(out, 2):
                restarted = time.monotonic() - t0
            time.sleep(0.1)
        err = _ends_by_itself(p, 5)
        ended = time.monotonic() - t0
    again = f"a new attempt trained {restarted:.1f}s after" if restarted else "no restart"
    print(f"{mode}: {len(hits)} port(s) hit ({sorted(set(hits.values()))}); {again}; "
          f"the job ended {ended:.1f}s after the first packet, exit {p.returncode}")
    assert p.returncode == 0, err[-3000:]
    if mode != "garbage":
        assert restarted is None, "a packet that is not garbage cost a restart"


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["garbage", "close"])
def test_packets_while_an_attempt_starts_may_fail_it_but_the_job_goes_on(cli, mode):
    """Each port of the first attempt is hit the moment it listens, before or as the RPC world forms."""
    path = cli.write(job(LONG, steps=20))
    out = cli.tmp / "state" / "dp"
    hits: dict[tuple[str, int], str] = {}
    first = None  # the first attempt's coordinator process: its ports, then its workers', are hit while it lives
    with cli.running("run", str(path), "--state-dir", str(cli.tmp / "state"), "--no-progress") as p:
        t0 = deadline = time.monotonic() + 120
        while p.poll() is None and not steps_done(out) and time.monotonic() < deadline:
            found = attempt_ports(cli.tag)
            first = first or next((pid for pid, (kind, _) in found.items() if kind == "coordinator"), None)
            if first is not None and first not in found:
                break  # the first attempt ended
            for _, addrs in found.values():
                for a in sorted(addrs - set(hits)):
                    t0 = t0 if hits else time.monotonic()
                    hits[a] = _hit(*a, mode)
            time.sleep(0.002)
        assert hits, "no attempt port was seen listening"
        t_last = time.monotonic()
        err = _ends_by_itself(p, 150)
        ended = time.monotonic() - t0
    restarts = err.count("RESTARTING")
    print(f"{mode} at start: {len(hits)} port(s) hit over {t_last - t0:.1f}s; {restarts} restart(s); "
          f"the job ended {ended:.1f}s after the first packet, exit {p.returncode}")
    assert p.returncode == 0, err[-3000:]
