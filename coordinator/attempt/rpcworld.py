"""The coordinator's end of an attempt's torch RPC world: joining it, its stages' handles, leaving it.

The coordinator is RPC rank 0; worker rank N (stage N mod P of replica N div
P: gpipe.topology) is RPC rank N+1. It creates each stage on its worker
(rpc.remote of gpipe.worker.stage_server.StageServer) and drives it through a
handle on its RRef (gpipe.coordinator.attempt.handle.RRefStage). One store serves the RPC
rendezvous and the stages' data-plane process group.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import asdict

import torch.distributed.rpc as rpc

from gpipe.contract import Cause
from gpipe.coordinator.attempt.handle import RRefStage, StageHandle
from gpipe.coordinator.plan.configs import stage_config
from gpipe.coordinator.plan.job import Plan
from gpipe.errors import JobFailed
from gpipe.service import net
from gpipe.worker.stage_server import StageServer


class RpcWorld:
    """The RPC world of one attempt of `plan`, its rendezvous at store_host:store_port."""

    def __init__(self, plan: Plan, store_host: str, store_port: int, device_of: Callable[[int], str]):
        self.plan, self.spec, self.topology = plan, plan.spec, plan.spec.topology
        self.store_host, self.store_port = store_host, store_port
        self.master = f"{store_host}:{store_port}"
        self.device_of = device_of
        self.rrefs: list[rpc.RRef[StageServer]] = []

    def join(self, name_of: Callable[[int], str]) -> None:
        """Start this end of the RPC world, within start_timeout_s (`name_of` names a rank's stage)."""
        spec = self.spec
        opts = net.rpc_options(self.master, spec.start_timeout_s)
        err: list[BaseException] = []

        def init() -> None:
            try:
                rpc.init_rpc(  # type: ignore[no-untyped-call]  # torch.distributed.rpc has no annotations
                    "coordinator", rank=0, world_size=self.topology.world + 1, rpc_backend_options=opts)
            except BaseException as e:
                err.append(e)

        t = threading.Thread(target=init, name="rpc-init", daemon=True)
        t.start()
        t.join(spec.start_timeout_s)
        if t.is_alive():
            raise JobFailed(f"timed out after {spec.start_timeout_s:.0f}s waiting for the workers to join: "
                            f"{self._who_did_not_join(name_of)}", cause=Cause.TIMEOUT)
        if err:
            raise JobFailed(f"the RPC world could not start: {str(err[0]).splitlines()[0]}", cause=Cause.PEER)

    def _who_did_not_join(self, name_of: Callable[[int], str]) -> str:
        """Which workers never reached the rendezvous, or else where the ones that did listen."""
        store = net.master_store(self.store_port)
        if store is None:
            return "no rendezvous store"
        reached: dict[int, str] = {}
        for k in self.topology.ranks():
            key = f"{net.REACHED_KEY}{k}"
            with contextlib.suppress(Exception):
                if store.check([key]):
                    reached[k] = store.get(key).decode(errors="replace")
        missing = [k for k in self.topology.ranks() if k not in reached]
        if missing:
            return (f"{', '.join(name_of(k) for k in missing)} never reached the rendezvous at "
                    f"{self.master}: check that its worker can reach this address (serve --host sets it)")
        where = ", ".join(f"{self.topology.name(k)} at {a}" for k, a in sorted(reached.items()))
        return (f"every worker reached the rendezvous, but they could not all connect to each other ({where}): "
                "check that these addresses reach one another (gpipe-worker --host sets a worker's)")

    def stages(self, first_step: int) -> list[StageHandle]:
        """Create every rank's stage on its worker (its layers only: the rest comes in pieces); by rank. With
        virtual stages, a stage per model chunk, by slot (gpipe.topology), virtual_stages of them on each worker."""
        spec, top = self.spec, self.topology
        slots = top.model_chunks()
        for slot in slots.slots():
            rank = top.worker_of(slot)
            cfg = stage_config(self.plan, slots.model_chunk_of(slot), slots.replica_of(slot), self.device_of(rank),
                                 self.store_host, self.store_port)
            args = (asdict(cfg), None, first_step)
            self.rrefs.append(rpc.remote(top.rpc_name(rank), StageServer, args=args, timeout=spec.start_timeout_s))
        return [RRefStage(r, spec.start_timeout_s, spec.step_timeout_s) for r in self.rrefs]

    def leave(self, graceful: bool, timeout: float = 30.0) -> bool:
        """Drop the stages' RRefs and leave the world; True if it was left within `timeout`."""
        self.rrefs.clear()
        return shutdown(graceful, timeout)


def shutdown(graceful: bool, timeout: float = 30.0) -> bool:
    """Leave the RPC world; True if it was left within `timeout`."""
    def leave() -> None:
        try:
            rpc.shutdown(graceful=graceful)
        except RuntimeError:  # never joined: nothing to leave
            pass

    t = threading.Thread(target=leave, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()
